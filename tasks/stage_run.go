package tasks

// Stage 5, run. Receives a job due now; for an outside task, the outsideRun
// of its claim. Runs the task function (execute) under its time limits, its
// revocation and panic recovery, and hands on the encoded result or the
// task's error, a retry request among them (a failure past the task's
// MaxRetries: taskOutcome, retry.go), to the settle stage. Pure tasks (no
// record) and same-database tasks (claim, run and completion in one
// transaction) are run end to end here and go on to the answer stage
// (finish), or with a claim's other outcome to answerClaim.

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/workerhooks"
)

// run runs the task under the claim's lease heartbeat
// (idempotency.Store.KeepOn) and hands on its encoded result, its error
// and whether the lease was lost while it ran.
func (o *outsideRun) run(ctx context.Context) (res []byte, taskErr error, leaseLost bool) {
	w, j := o.w, o.j
	w.crash(workerhooks.AfterClaim, j)
	// The heartbeat cancels the task's own context (no context of its
	// own between the task's and ctx) and is stopped before execute
	// returns.
	var tctx context.Context
	res, taskErr = w.execute(ctx, j, w.call(j, j.attempt), func(ctx context.Context, c *Call) (any, error) {
		return j.h.run(ctx, c, j.args)
	}, func(kctx context.Context, cancel context.CancelCauseFunc) func() {
		tctx = kctx
		return w.store.KeepOn(kctx, cancel, o.ref, o.p.Lease, o.since)
	})
	leaseLost = errors.Is(context.Cause(tctx), idempotency.ErrLeaseLost)
	w.crash(workerhooks.AfterEffect, j)
	return res, taskErr, leaseLost
}

// runPure runs a task without a record. Its crash points are before the
// run (after_claim: there is no claim) and after it returns (after_effect).
func (w *Worker) runPure(ctx context.Context, j *job) {
	w.crash(workerhooks.AfterClaim, j)
	res, err := w.execute(ctx, j, w.call(j, 0), func(ctx context.Context, c *Call) (any, error) {
		return j.h.run(ctx, c, j.args)
	}, nil)
	w.crash(workerhooks.AfterEffect, j)
	if errors.Is(err, errRevokedWaiting) {
		w.revokeDelivery(ctx, j, false)
		return
	}
	if shutdownCut(ctx, err) {
		w.giveBack(j)
		return
	}
	w.finish(ctx, j, res, err)
}

// taskTxOf is the transaction a same-database task is given: tx, and when
// the task has a hard time limit, a guard that keeps a task abandoned at
// that limit (while it still holds tx) off the connection from then on.
func taskTxOf(j *job, tx pgx.Tx) (pgx.Tx, *txGuard) {
	var ttx pgx.Tx = &taskTx{Tx: tx}
	if j.hardLimit() <= 0 {
		return ttx, nil
	}
	guard := newTxGuard()
	return &guardedTx{g: guard, tx: ttx}, guard
}

// taskTxFailed answers a same-database task whose function failed, its
// transaction rolled back: revoked while it waited (nothing ran), cut by
// the shutdown's grace period (given back), failed by the database rather
// than the task (run again after a pause), or the task's own error.
func (w *Worker) taskTxFailed(ctx context.Context, j *job, taskErr error, connClosed bool, what string) {
	switch {
	case errors.Is(taskErr, errRevokedWaiting):
		w.revokeDelivery(ctx, j, false)
	case shutdownCut(ctx, taskErr):
		w.giveBack(j)
	case !j.abandoned && dbFault(taskErr, connClosed):
		w.recordTrouble(ctx, j, what, taskErr)
	default:
		w.finish(ctx, j, nil, taskErr)
	}
}

// runSameDB claims, runs the effect and completes in one transaction.
func (w *Worker) runSameDB(ctx context.Context, j *job) {
	if !w.countRedelivery(ctx, j) {
		return
	}
	p := w.claimParams(j)
	// The claim commits alone only when the task ended its transaction
	// itself: then the operation is held, with its message to replay.
	p.HeldMessage = func() []byte { return w.heldCopy(j) }
	var taskErr error
	ran, connClosed := false, false
	start := time.Now()
	claim, err := w.store.RunTx(ctx, p, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		// A transaction group may call this more than once (a first call
		// rolled back with its group, then a call in a savepoint of its
		// own): only the last call's outcome is the operation's.
		taskErr, connClosed = nil, false
		w.m.claimSecs.Observe(time.Since(start).Seconds())
		w.crash(workerhooks.AfterClaim, j)
		ran = true
		ttx, guard := taskTxOf(j, tx)
		out, err := w.execute(ctx, j, w.call(j, 0), func(ctx context.Context, c *Call) (any, error) {
			return w.runTxBody(ctx, j, ttx, c)
		}, nil)
		if j.abandoned && guard != nil {
			if guard.abandon(tx, time.Second) {
				w.log.Warn("abandoned task kept its query running: connection closed to roll its transaction back", w.fields(j)...)
			}
		}
		if err != nil {
			taskErr = err
			connClosed = tx.Conn().IsClosed()
			return nil, err
		}
		w.crash(workerhooks.AfterEffect, j)
		return out, nil
	})
	switch {
	case ran && taskErr != nil:
		w.taskTxFailed(ctx, j, taskErr, connClosed, "same-database transaction (task)")
	case err != nil && taskCaused(err):
		// The task's own work failed its transaction (a deferred
		// constraint at commit, a statement error it caught, a transaction
		// it ended itself), or the database refuses its result: nothing
		// committed (a transaction the task committed itself is held), and
		// it fails like any task error, retried as its policy says.
		w.log.Warn("the task's transaction failed by its own work", w.fields(j, zap.Error(err))...)
		w.finish(ctx, j, nil, taskOutcome(j, nil, err))
	case err != nil:
		w.recordTrouble(ctx, j, "same-database transaction", err)
	default:
		w.answerClaim(ctx, j, claim)
	}
}

// runTxBody runs a same-database task's body in tx. A RunStmt task without
// time limits hands its statement to its transaction group when it runs in
// one (idempotency.Defer), which runs it with the others' in one round
// trip; with a limit it runs it here, where the limit applies to it.
func (w *Worker) runTxBody(ctx context.Context, j *job, tx pgx.Tx, c *Call) (any, error) {
	if j.h.stmt == nil {
		return j.h.runTx(ctx, tx, c, j.args)
	}
	return j.h.runStmt(ctx, tx, c, j.args, j.hardLimit() <= 0 && j.softLimit() <= 0)
}

// taskCaused reports whether an error of the record's RunTx belongs to the
// task's own work: a *idempotency.TaskTxError, or a definite refusal (the
// task's result is one the database cannot store).
func taskCaused(err error) bool {
	var te *idempotency.TaskTxError
	return errors.As(err, &te) || idempotency.IsDefinite(err)
}

func (w *Worker) call(j *job, attempt int) *Call {
	c := &Call{TaskID: j.msg.ID, Key: j.key, Retries: j.msg.Retries, Attempt: attempt, Message: j.msg,
		Node: w.cfg.Hostname, retry: j.h.retry}
	if j.key != "" {
		c.Reference = reference(j.h.name, j.key)
	}
	return c
}

// execute runs the task function with its time limits, revocation and panic
// recovery, decides on retries (taskOutcome) and encodes its result as JSON.
// At the hard time limit the task's context is cancelled (cause ErrTimeLimit); a
// task that has not returned hardLimitSettle later is abandoned: execute
// returns an ErrTimeLimit error and marks j.abandoned while the task's
// goroutine runs on until it returns (Run waits for it).
func (w *Worker) execute(ctx context.Context, j *job, c *Call, fn func(context.Context, *Call) (any, error), keep func(context.Context, context.CancelCauseFunc) func()) (res []byte, err error) {
	tctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	if keep != nil {
		defer keep(tctx, cancel)()
	}
	if soft := j.softLimit(); soft > 0 {
		var stop context.CancelFunc
		tctx, stop = context.WithTimeoutCause(tctx, soft, ErrSoftTimeLimit)
		defer stop()
	}
	hard := j.hardLimit()
	if hard > 0 {
		var stop context.CancelFunc
		tctx, stop = context.WithTimeoutCause(tctx, hard, ErrTimeLimit)
		defer stop()
	}
	rs := &runState{started: time.Now(), cancel: cancel}
	w.mu.Lock()
	if w.revoked.has(j.msg.ID) {
		// Revoked while it waited (for the record, a connection, a turn):
		// it does not start, as in Celery, whose worker looks again just
		// before running a task. Checked under the lock Revoke takes, so a
		// revoke either finds it active (terminate) or stops it here.
		w.mu.Unlock()
		return nil, errRevokedWaiting
	}
	delete(w.reserved, j)
	w.active[j] = rs
	w.mu.Unlock()
	if r, ok := j.d.(runMarker); ok {
		r.runStarted()
		defer func() { r.runEnded(err != nil) }()
	}
	w.m.inFlight.Inc()
	if w.wantEvents() {
		w.event(ctx, j, &celeryproto.TaskEvent{Type: "task-started"})
	}
	w.markStarted(ctx, j)
	defer func() {
		w.mu.Lock()
		delete(w.active, j)
		w.totals[j.h.name]++
		w.mu.Unlock()
		w.m.inFlight.Dec()
		j.runtime = time.Since(rs.started)
		w.taskMetricsOf(j.h).secondsOf(w.m, j.h.name).Observe(j.runtime.Seconds())
	}()
	var v any
	if hard > 0 || j.h.mode != ModeSameDB {
		// On a goroutine of its own, so that the task can be abandoned at
		// its hard time limit or by a terminating revoke. A same-database
		// task without a time limit is run inline: its transaction has no
		// guard to keep an abandoned task off the connection.
		v, err = w.runLimited(tctx, j, c, fn, hard)
	} else {
		v, err = protect(tctx, c, fn)
	}
	if err != nil {
		cause := context.Cause(tctx)
		if errors.Is(cause, ErrRevoked) || errors.Is(cause, ErrTimeLimit) || errors.Is(cause, ErrSoftTimeLimit) {
			if !errors.Is(err, cause) {
				err = fmt.Errorf("%w: %w", cause, err)
			}
		}
		return nil, taskOutcome(j, cause, err)
	}
	return encodeResult(v)
}

// hardLimitSettle is how long a task may take to return after its hard time
// limit (or a terminating revoke) cancelled its context before it is
// abandoned.
const hardLimitSettle = 100 * time.Millisecond

// runLimited calls fn on a goroutine of its own, so that the task can be
// abandoned at its hard time limit (hard, 0 for none) or when a revoke
// terminates it. Go cannot stop a goroutine: an abandoned task runs on (its
// context cancelled) until it returns; its result is then discarded.
// w.tasks counts these goroutines; Run waits for them.
func (w *Worker) runLimited(tctx context.Context, j *job, c *Call, fn func(context.Context, *Call) (any, error), hard time.Duration) (any, error) {
	type outcome struct {
		v   any
		err error
	}
	done := make(chan outcome, 1)
	var abandoned atomic.Bool
	w.tasks.Add(1)
	go func() {
		defer w.tasks.Done()
		start := time.Now()
		v, err := protect(tctx, c, fn)
		if abandoned.Load() {
			w.log.Warn("abandoned task returned; its outcome is discarded",
				w.fields(j, zap.Duration("ran", time.Since(start)), zap.NamedError("task_error", err))...)
		}
		done <- outcome{v, err}
	}()
	select {
	case o := <-done:
		return o.v, o.err
	case <-tctx.Done():
	}
	cause := context.Cause(tctx)
	revoked := errors.Is(cause, ErrRevoked)
	if !revoked && !errors.Is(cause, ErrTimeLimit) {
		// Soft time limit, lease loss, shutdown: the task is asked to stop
		// and waited for.
		o := <-done
		return o.v, o.err
	}
	settle := time.NewTimer(hardLimitSettle)
	defer settle.Stop()
	select {
	case o := <-done:
		return o.v, o.err
	case <-settle.C:
	}
	abandoned.Store(true)
	j.abandoned = true
	w.m.abandoned.WithLabelValues(j.h.name).Inc()
	if revoked {
		w.log.Error("terminated by revoke: task abandoned while it still runs", w.fields(j)...)
		return nil, fmt.Errorf("%w: task abandoned after a terminating revoke", ErrRevoked)
	}
	w.log.Error("hard time limit: task abandoned while it still runs", w.fields(j, zap.Duration("time_limit", hard))...)
	return nil, fmt.Errorf("%w: task abandoned at its hard time limit (%s)", ErrTimeLimit, hard)
}

// protect calls fn, turning a panic into a PanicError.
func protect(ctx context.Context, c *Call, fn func(context.Context, *Call) (any, error)) (v any, err error) {
	defer func() {
		if r := recover(); r != nil {
			v, err = nil, &PanicError{Value: r, Stack: debug.Stack(), pcs: panicPCs()}
		}
	}()
	v, err = fn(ctx, c)
	if err != nil {
		if _, ok := errorText(err); !ok {
			// An error whose Error method panics (a nil pointer in an
			// error value) would panic wherever it is answered or logged.
			err = fmt.Errorf("the task returned a %T whose Error method panicked", err)
		}
	}
	return v, err
}

func (j *job) softLimit() time.Duration {
	if j.limits.soft > 0 {
		return j.limits.soft
	}
	return j.msg.TimeLimit.Soft
}

func (j *job) hardLimit() time.Duration {
	if j.limits.hard > 0 {
		return j.limits.hard
	}
	return j.msg.TimeLimit.Hard
}

// ErrTimeLimit is the cause of a task context cancelled by its hard time
// limit; the caller gets FAILURE billiard.exceptions.TimeLimitExceeded.
var ErrTimeLimit = errors.New("time limit exceeded")

// shutdownCut reports whether err is the task's answer to the worker's
// grace period running out: then nothing is recorded or acknowledged.
func shutdownCut(ctx context.Context, err error) bool {
	return err != nil && errors.Is(context.Cause(ctx), ErrShutdown)
}
