package tasks

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"strconv"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/pause"
	"github.com/onceler/onceler/internal/workerhooks"
)

// runOutside claims the operation, applies the stale-claim policy if needed,
// runs the task under a lease heartbeat and completes the record.
func (w *Worker) runOutside(ctx context.Context, j *job) {
	if j.waiting && !w.recheck(ctx, j) {
		return
	}
	p := w.claimParams(j)
	if j.claimToken == "" {
		j.claimToken = idempotency.NewToken()
	}
	// Until the claim's outcome is known, every claim of this delivery takes
	// the same token: a claim (or takeover) that committed while its answer
	// was lost is then found to be this delivery's own, not in progress.
	p.Token = j.claimToken
	start := time.Now()
	claim, err := w.store.Claim(ctx, p)
	w.m.claimSecs.Observe(time.Since(start).Seconds())
	if err != nil {
		w.recordTrouble(ctx, j, "claim", err)
		return
	}
	tookOver := false
	if claim.Outcome == idempotency.OutcomeStale {
		tookOver = true
		claim, err = w.applyPolicy(ctx, j, p, claim)
		if err != nil {
			// The policy may have taken the claim over with this delivery's
			// token and failed after (the completion after a lookup, a
			// fallback hold): a claim with that token would be this
			// delivery's own and run the task, whatever the policy decided.
			// The next claim takes a new token and finds the record as the
			// policy left it (once its lease lapses, stale again: the policy
			// decides again).
			j.claimToken = ""
			w.recordTrouble(ctx, j, "stale policy", err)
			return
		}
	}
	j.claimToken = ""
	if claim.Outcome != idempotency.OutcomeFirst {
		w.answerClaim(ctx, j, claim)
		return
	}
	if crashes := claim.Attempt - j.msg.Retries; j.d.Redelivered && crashes > w.cfg.MaxAttempts {
		// A redelivered message whose operation was claimed this often keeps
		// killing its workers: stop the loop. Each Celery retry claims the
		// operation once more: those claims are not counted.
		ref := p.Ref(claim.Token)
		perr := fmt.Errorf("operation claimed %d times besides %d retries (limit %d)", crashes, j.msg.Retries, w.cfg.MaxAttempts)
		fctx, cancel := final(ctx)
		err := w.store.Fail(fctx, ref, "quarantined as poison: "+perr.Error())
		cancel()
		if err != nil {
			w.recordTrouble(ctx, j, "fail", err)
			return
		}
		w.quarantinePoison(ctx, j, perr)
		return
	}
	j.attempt = claim.Attempt
	ref := p.Ref(claim.Token)
	since := claim.Since
	if tookOver || time.Since(since) > p.Lease/3 {
		// A takeover (its lookup took some of the lease) or a slow claim:
		// the database must say the lease still holds before the task
		// starts, and the renewal starts it afresh.
		renewed := time.Now()
		if err := w.store.Renew(ctx, ref, p.Lease); err != nil {
			// The task has not run: the next claim takes this claim's token
			// again, so that it finds the claim its own (first, the lease
			// renewed) unless another delivery took it over meanwhile;
			// with a new token it would find its own claim stale and hand an
			// operation that never ran to the stale-claim policy.
			j.claimToken = claim.Token
			if errors.Is(err, idempotency.ErrFenced) {
				w.log.Warn("claim lapsed before the task started; not run yet", w.fields(j)...)
				w.deferDelivery(j, time.Time{})
				return
			}
			w.recordTrouble(ctx, j, "renew before run", err)
			return
		}
		since = renewed
	}
	w.crash(workerhooks.AfterClaim, j)
	kctx, stop := w.store.KeepSince(ctx, ref, p.Lease, since)
	res, taskErr := w.execute(kctx, j, w.call(j, claim.Attempt), func(ctx context.Context, c *Call) (any, error) {
		return j.h.run(ctx, c, j.args)
	})
	leaseLost := errors.Is(context.Cause(kctx), idempotency.ErrLeaseLost)
	stop()
	w.crash(workerhooks.AfterEffect, j)
	switch {
	case errors.Is(taskErr, errRevokedWaiting):
		// It never ran: the claim is released, the caller told REVOKED.
		if err := w.write(ctx, j, "release", func(c context.Context) error { return w.store.Release(c, ref) }); err == nil || errors.Is(err, idempotency.ErrFenced) {
			w.revokeDelivery(ctx, j, false)
		}
	case taskErr != nil && leaseLost:
		// The task stopped because the claim could not be renewed; another
		// delivery may own the operation now. Record nothing; look again
		// later, when the record says what happened.
		w.log.Warn("lease lost while the task ran; outcome not recorded", w.fields(j, zap.Error(taskErr))...)
		w.deferDelivery(j, time.Time{})
	case taskErr == nil:
		// Even after a lost lease: the token fences the completion if
		// another delivery took the operation over. The caller gets the
		// result as the record keeps it, as a duplicate's caller does.
		var stored []byte
		err := w.write(ctx, j, "complete", func(c context.Context) (err error) {
			stored, err = w.store.Complete(c, ref, res)
			return err
		})
		switch {
		case err == nil:
			w.finish(ctx, j, stored, nil)
		case errors.Is(err, idempotency.ErrFenced):
			w.log.Warn("claim was taken over before completion; result discarded", w.fields(j)...)
			w.deferDelivery(j, time.Time{})
		case idempotency.IsDefinite(err):
			// The effect happened, but the database refuses its result:
			// held for a person, the caller told so.
			w.unstorable(ctx, j, ref, err)
		}
	case j.abandoned:
		// The task still runs: its outcome is unknown. Its claim goes to
		// the task's stale-claim policy now, not at a redelivery that
		// may never come: held (hold, lookup), skipped (skip) or failed
		// (retry: claimable again). The caller gets TimeLimitExceeded
		// (REVOKED after a terminating revoke) and the delivery is
		// acknowledged.
		if w.settleAbandoned(ctx, j, ref) {
			w.finish(ctx, j, nil, taskErr)
		}
	case w.shutdownCut(ctx, taskErr):
		// Cut off by the shutdown: whether the task reached the outside
		// system is unknown. Its lease ends now, so that the redelivery goes
		// to the task's stale-claim policy (released, it would simply run
		// again); if that write fails, the lease runs out by itself.
		fctx, cancel := final(ctx)
		if err := w.store.Lapse(fctx, ref); err != nil {
			w.log.Warn("ending the lease after shutdown failed; it runs out by itself", w.fields(j, zap.Error(err))...)
		} else {
			w.log.Info("task cut off by shutdown: its claim is left stale for the stale-claim policy", w.fields(j)...)
		}
		cancel()
		w.giveBack(j)
	case IsRetry(taskErr):
		if err := w.write(ctx, j, "release", func(c context.Context) error { return w.store.Release(c, ref) }); err == nil || errors.Is(err, idempotency.ErrFenced) {
			w.finish(ctx, j, nil, taskErr)
		}
	default:
		if err := w.write(ctx, j, "fail", func(c context.Context) error { return w.store.Fail(c, ref, taskErr.Error()) }); err == nil || errors.Is(err, idempotency.ErrFenced) {
			w.finish(ctx, j, nil, taskErr)
		}
	}
}

// write makes a final record write for a claim this delivery holds,
// retrying while the database does not answer. It returns nil,
// idempotency.ErrFenced or a definite refusal (idempotency.IsDefinite),
// which the caller acts on; any other outcome means the worker is stopping
// and the delivery was given back to the broker (its redelivery finds the
// claim).
func (w *Worker) write(ctx context.Context, j *job, what string, op func(context.Context) error) error {
	for attempt := 0; ; attempt++ {
		fctx, cancel := final(ctx)
		err := op(fctx)
		cancel()
		if err == nil || errors.Is(err, idempotency.ErrFenced) || idempotency.IsDefinite(err) {
			return err
		}
		w.log.Warn("record write failed; retrying", w.fields(j, zap.String("step", what), zap.Error(err))...)
		if ctx.Err() != nil || !pause.For(ctx, min(50*time.Millisecond<<min(attempt, 5), 2*time.Second)) {
			w.giveBack(j)
			return fmt.Errorf("%s: %w", what, err)
		}
	}
}

// recheck looks at the record of an operation found in progress earlier,
// without claiming (a claim would count the delivery as a duplicate again).
// It answers the delivery and returns false when the record says what to
// do; true means claim again (the owner failed, released or went stale).
func (w *Worker) recheck(ctx context.Context, j *job) bool {
	rec, err := w.store.Get(ctx, j.h.name, j.key)
	switch {
	case errors.Is(err, idempotency.ErrNotFound):
	case err != nil:
		w.recordTrouble(ctx, j, "recheck", err)
		return false
	case rec.Status == idempotency.StatusCompleted:
		w.duplicate(ctx, j, rec.Result)
		return false
	case rec.Live:
		// Claimed and its lease running, by the database's clock.
		w.deferDelivery(j, rec.LeaseUntil)
		return false
	}
	j.waiting = false
	return true
}

// applyPolicy settles a stale claim by the task's policy.
func (w *Worker) applyPolicy(ctx context.Context, j *job, p idempotency.ClaimParams, stale idempotency.Claim) (idempotency.Claim, error) {
	h := j.h
	w.log.Warn("stale claim: applying policy", w.fields(j, zap.String("policy", h.policy.String()),
		zap.String("stale_owner", stale.Owner), zap.String("stale_task_id", stale.TaskID))...)
	w.m.stale.WithLabelValues(h.name, h.policy.String()).Inc()
	sp := idempotency.StalePolicy{Policy: h.policy, Fallback: h.fallback, LookupTimeout: h.lookupTimeout}
	if h.policy == PolicyHold || h.fallback == PolicyHold {
		p.Message = w.heldCopy(j)
	}
	if h.lookup != nil {
		sp.Lookup = func(ctx context.Context, key string) ([]byte, bool, error) {
			c := w.call(j, stale.Attempt+1)
			v, found, err := h.lookup(ctx, c, j.args)
			if err != nil || !found {
				return nil, found, err
			}
			b, err := encodeResult(v)
			return b, err == nil, err
		}
	}
	return w.store.ApplyPolicy(ctx, p, stale, sp)
}

// unstorable settles the claim ref of a task whose effect happened but
// whose result the database refuses (err): held for a person (its message
// kept to replay), and the caller answered FAILURE
// onceler.exceptions.ResultNotStored; then the delivery is acknowledged.
func (w *Worker) unstorable(ctx context.Context, j *job, ref idempotency.Ref, err error) {
	w.log.Error("the record refuses the task's result; operation held", w.fields(j, zap.Error(err))...)
	msg := w.heldCopy(j)
	reason := "the task's result could not be stored: " + err.Error()
	herr := w.write(ctx, j, "hold", func(c context.Context) error { return w.store.HoldOwn(c, ref, msg, reason) })
	switch {
	case herr == nil:
		w.m.held.WithLabelValues(j.h.name).Inc()
	case errors.Is(herr, idempotency.ErrFenced):
	case idempotency.IsDefinite(herr):
		w.log.Error("holding the operation failed too; its claim lapses into its policy", w.fields(j, zap.Error(herr))...)
	default:
		return // given back: the worker is stopping
	}
	exc := &celeryproto.Exception{Type: "ResultNotStored", Module: "onceler.exceptions",
		Message: "the task ran, but the idempotency record refused its result (operation held): " + err.Error()}
	if w.wantEvents() {
		w.event(ctx, j, failedEvent("task-failed", j.h.name, exc))
	}
	if w.replyFailure(ctx, j, exc, err) {
		w.ack(j)
	}
}

// settleAbandoned hands the claim ref of a task abandoned while it still
// runs to its stale-claim policy at once: the effect may happen yet, so
// hold and lookup hold it (a person decides; the lookup could not see an
// effect still in flight), skip skips it, and retry fails it (claimable
// again, the rare duplicate that policy accepts). The write is retried
// while the database does not answer; false means the worker is stopping
// and the delivery was given back (its redelivery finds the claim, which
// by then has lapsed into the policy).
func (w *Worker) settleAbandoned(ctx context.Context, j *job, ref idempotency.Ref) bool {
	reason := "the task was abandoned still running: its effect may or may not happen"
	msg := w.heldCopy(j)
	err := w.write(ctx, j, "settle abandoned", func(c context.Context) error {
		switch j.h.policy {
		case PolicySkip:
			return w.store.SkipOwn(c, ref, reason)
		case PolicyRetry:
			return w.store.Fail(c, ref, reason)
		default:
			return w.store.HoldOwn(c, ref, msg, reason)
		}
	})
	switch {
	case err == nil:
		w.log.Warn("the claim of an abandoned task was settled by its policy", w.fields(j, zap.String("policy", j.h.policy.String()))...)
	case errors.Is(err, idempotency.ErrFenced):
		// Settled already (a person, or a takeover once it lapsed).
	case idempotency.IsDefinite(err):
		w.log.Error("settling an abandoned task's claim was refused; it lapses into its policy", w.fields(j, zap.Error(err))...)
	default:
		return false
	}
	return true
}

// execute runs the task function with its time limits, revocation and panic
// recovery, settles retries (settle) and encodes its result as JSON. At the
// hard time limit the task's context is cancelled (cause ErrTimeLimit); a
// task that has not returned hardLimitSettle later is abandoned: execute
// returns an ErrTimeLimit error and marks j.abandoned while the task's
// goroutine runs on until it returns (Run waits for it).
func (w *Worker) execute(ctx context.Context, j *job, c *Call, fn func(context.Context, *Call) (any, error)) (res []byte, err error) {
	tctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	if soft := w.softLimit(j); soft > 0 {
		var stop context.CancelFunc
		tctx, stop = context.WithTimeoutCause(tctx, soft, ErrSoftTimeLimit)
		defer stop()
	}
	hard := w.hardLimit(j)
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
		w.m.taskSeconds.WithLabelValues(j.h.name).Observe(j.runtime.Seconds())
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
		return nil, settle(j, cause, err)
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
			v, err = nil, &PanicError{Value: r, Stack: debug.Stack()}
		}
	}()
	return fn(ctx, c)
}

func (w *Worker) softLimit(j *job) time.Duration {
	if soft := w.taskSoftLimit(j.h); soft > 0 {
		return soft
	}
	return j.msg.TimeLimit.Soft
}

func (w *Worker) hardLimit(j *job) time.Duration {
	if hard := w.taskHardLimit(j.h); hard > 0 {
		return hard
	}
	return j.msg.TimeLimit.Hard
}

// finish answers a delivery whose outcome is recorded (or that has no
// record): the result to the caller, then the ack.
func (w *Worker) finish(ctx context.Context, j *job, res []byte, taskErr error) {
	msg := j.msg
	if taskErr == nil {
		w.m.succeeded.WithLabelValues(j.h.name).Inc()
		if ce := w.log.Check(zap.DebugLevel, "task succeeded"); ce != nil {
			ce.Write(w.fields(j)...)
		}
		if w.wantEvents() {
			w.event(ctx, j, succeededEvent(res, j.runtime.Seconds(), false))
		}
		// Workflow steps (link callbacks, the chain's next step) go out, with
		// a confirm, before the result: Celery publishes them before it
		// stores SUCCESS.
		if !w.followUp(ctx, j, res) || !w.replySuccess(ctx, j, res) {
			return
		}
		w.crash(workerhooks.BeforeAck, j)
		w.ack(j)
		return
	}
	var rr *RetryRequest
	if errors.As(taskErr, &rr) {
		w.retry(ctx, j, rr)
		return
	}
	if errors.Is(taskErr, ErrRevoked) {
		w.m.revoked.WithLabelValues(j.h.name).Inc()
		w.log.Info("running task terminated by revoke", w.fields(j)...)
		if w.wantEvents() {
			w.event(ctx, j, &celeryproto.TaskEvent{Type: "task-revoked", Terminated: true, Signum: 15})
		}
		exc := &celeryproto.Exception{Type: "TaskRevokedError", Module: "celery.exceptions", Message: "terminated"}
		if w.publishResult(ctx, j, &celeryproto.Result{TaskID: msg.ID, Status: celeryproto.StateRevoked, Exception: exc}) {
			w.ack(j)
		}
		return
	}
	w.m.failed.WithLabelValues(j.h.name).Inc()
	var pe *PanicError
	if errors.As(taskErr, &pe) {
		w.log.Error("task panicked", w.fields(j, zap.Any("panic", pe.Value), zap.ByteString("stack", pe.Stack))...)
	} else {
		w.log.Info("task failed", w.fields(j, zap.Error(taskErr))...)
	}
	exc := exceptionFor(taskErr)
	if errors.Is(taskErr, ErrTimeLimit) {
		exc = &celeryproto.Exception{Type: "TimeLimitExceeded", Module: "billiard.exceptions", Message: strconv.FormatFloat(w.hardLimit(j).Seconds(), 'g', -1, 64)}
	}
	if w.wantEvents() {
		w.event(ctx, j, failedEvent("task-failed", j.h.name, exc))
	}
	if !w.replyFailure(ctx, j, exc, taskErr) || !w.failWorkflow(ctx, j, exc, taskErr.Error()) {
		return
	}
	w.crash(workerhooks.BeforeAck, j)
	w.ack(j)
}

// ErrTimeLimit is the cause of a task context cancelled by its hard time
// limit; the caller gets FAILURE billiard.exceptions.TimeLimitExceeded.
var ErrTimeLimit = errors.New("time limit exceeded")

// jsonValue turns stored JSON into a value the result encoder writes back
// unchanged (integers stay integers).
func jsonValue(b []byte) (any, error) {
	if len(b) == 0 {
		return nil, nil
	}
	v, err := celeryproto.DecodeJSON(b)
	if err != nil {
		return nil, fmt.Errorf("decode stored result: %w", err)
	}
	return v, nil
}
