package tasks

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/clip"
	"github.com/onceler/onceler/internal/workerhooks"
)

// Quarantine reasons, the value of the x-onceler-reason header.
const (
	ReasonUndecodable  = "undecodable"
	ReasonUnknownTask  = "unknown_task"
	ReasonBadArguments = "bad_arguments"
	ReasonMismatch     = "fingerprint_mismatch"
	ReasonPoison       = "poison"
	// ReasonRefused: the record's database refused what the message asked
	// it to keep, and would refuse it again.
	ReasonRefused = "refused_by_record"
)

// Reasons are the quarantine reasons a worker gives, in the order of the
// pipeline's checks.
var Reasons = []string{ReasonUndecodable, ReasonPoison, ReasonUnknownTask, ReasonBadArguments,
	ReasonUnsupported, ReasonMismatch, ReasonRefused, ReasonPublishRefused}

// process takes one delivery through the pipeline. Every path ends in exactly
// one of: ack (after the outcome is recorded and answered), a deferral (the
// delivery stays unacknowledged and is looked at again later), or no answer
// at all (the delivery returns to the queue when its channel closes).
func (w *Worker) process(ctx context.Context, j *job) {
	if j.d.Stale() {
		// Its channel is gone: the broker has it back and redelivers it.
		w.forget(j)
		return
	}
	if j.verdict != nil {
		w.quarantine(ctx, j, j.verdict.reason, j.verdict.cause)
		return
	}
	if !j.prepared && !w.prepare(ctx, j) {
		return
	}
	msg := j.msg
	if w.isRevoked(msg.ID) {
		w.revokeDelivery(ctx, j, false)
		return
	}
	if expired(msg) {
		w.revokeDelivery(ctx, j, true)
		return
	}
	if !msg.ETA.IsZero() {
		if wait := time.Until(msg.ETA); wait > 0 {
			if j.rehold {
				w.rehold(ctx, j)
				return
			}
			w.schedule(j, wait)
			return
		}
	}
	if w.rateLimited(j) {
		return
	}
	if j.h.mode == ModeSameDB && w.cfg.hooks.NoRecord {
		w.runOwnTx(ctx, j)
		return
	}
	if j.h.mode == ModePure || w.cfg.hooks.NoRecord {
		w.runPure(ctx, j)
		return
	}
	if j.h.mode == ModeSameDB {
		w.runSameDB(ctx, j)
		return
	}
	w.runOutside(ctx, j)
}

// expired reports whether msg's expiry has passed.
func expired(msg *celeryproto.Message) bool {
	return !msg.Expires.IsZero() && time.Now().After(msg.Expires)
}

// prepare decodes the delivery, finds its task, binds its arguments and
// derives its operation key. It answers (quarantine, ack) and returns false
// when the delivery cannot run.
func (w *Worker) prepare(ctx context.Context, j *job) bool {
	d := j.d
	msg, err := w.dec.Decode(&d.Delivery)
	if err != nil {
		w.quarantineUndecodable(ctx, j, err)
		return false
	}
	j.msg = msg
	if d.DeliveryCount > w.cfg.MaxAttempts {
		w.quarantinePoison(ctx, j, fmt.Errorf("delivered %d times (limit %d)", d.DeliveryCount, w.cfg.MaxAttempts))
		return false
	}
	h, ok := w.reg.get(msg.Task)
	if !ok {
		w.m.received.WithLabelValues("unregistered").Inc()
		w.log.Error("received unregistered task", zap.String("task", clip.String(msg.Task, maxLogField)), zap.String("task_id", clip.String(msg.ID, maxLogField)))
		exc := &celeryproto.Exception{Type: "NotRegistered", Module: "celery.exceptions", Message: msg.Task}
		if w.wantEvents() {
			// As Celery's consumer (on_unknown_task): task-failed, no
			// task-received.
			w.event(ctx, j, failedEvent("task-failed", msg.Task, exc))
		}
		// Even under ignore_result, as Celery does (only SUCCESS is dropped).
		if !w.publishResult(ctx, j, &celeryproto.Result{TaskID: msg.ID, Status: celeryproto.StateFailure, Exception: exc}) {
			return false
		}
		w.quarantine(ctx, j, ReasonUnknownTask, fmt.Errorf("task %q is not registered", msg.Task))
		return false
	}
	j.h = h
	w.m.received.WithLabelValues(h.name).Inc()
	if w.wantEvents() && !w.isRevoked(msg.ID) && !expired(msg) {
		// A revoked or expired message gets task-revoked alone, as from
		// Celery, whose worker looks at both before announcing a task.
		w.event(ctx, j, receivedEvent(j))
	}
	args, err := h.bind(msg.Args, msg.Kwargs)
	if err == nil && h.key != nil {
		j.key, err = w.operationKey(j, args)
	}
	if err != nil {
		var ae *ArgumentError
		if errors.As(err, &ae) {
			ae.Task = h.name
		}
		w.log.Warn("bad arguments", w.fields(j, zap.String("error", clip.String(err.Error(), maxLogField)))...)
		exc := exceptionFor(err)
		if w.wantEvents() {
			w.event(ctx, j, failedEvent("task-failed", h.name, exc))
		}
		// As Celery's TypeError from the call: the failure goes along the
		// workflow too.
		if !w.replyFailure(ctx, j, exc, err) || !w.failWorkflow(ctx, j, exc, err.Error()) {
			return false
		}
		w.quarantine(ctx, j, ReasonBadArguments, err)
		return false
	}
	j.args = args
	if why := w.workflowRefusal(msg); why != "" {
		w.refuseWorkflow(ctx, j, why)
		return false
	}
	if h.mode != ModePure && !w.cfg.hooks.NoRecord && !h.allowMismatch {
		fp, err := celeryproto.Fingerprint(msg.Args, msg.Kwargs)
		if err != nil {
			w.quarantine(ctx, j, ReasonBadArguments, fmt.Errorf("fingerprint: %w", err))
			return false
		}
		j.fp = fp
	}
	j.prepared = true
	return true
}

// operationKey is the idempotency_key header when the producer sent one,
// else the task's Key function of the arguments; it must be text the record
// can keep: UTF-8 without NUL, at most idempotency.MaxKeyBytes (the
// database would refuse every claim of it).
func (w *Worker) operationKey(j *job, args any) (string, error) {
	key, err := w.rawOperationKey(j, args)
	switch {
	case err != nil:
	case !celeryproto.StorableText(key):
		err = &ArgumentError{Reason: "operation key must be UTF-8 text without NUL"}
	case len(key) > idempotency.MaxKeyBytes:
		err = &ArgumentError{Reason: fmt.Sprintf("operation key of %d bytes: the record keeps keys of at most %d bytes",
			len(key), idempotency.MaxKeyBytes)}
	}
	return key, err
}

func (w *Worker) rawOperationKey(j *job, args any) (string, error) {
	if v, ok := j.msg.Headers["idempotency_key"]; ok && v != nil {
		switch k := v.(type) {
		case string:
			if k != "" {
				return k, nil
			}
		case []byte:
			if len(k) > 0 {
				return string(k), nil
			}
		}
		return "", &ArgumentError{Arg: "idempotency_key", Reason: "header must be a non-empty string"}
	}
	key, err := j.h.key(args)
	if err != nil {
		return "", &ArgumentError{Reason: "operation key: " + err.Error()}
	}
	if key == "" {
		return "", &ArgumentError{Reason: "operation key is empty"}
	}
	return key, nil
}

func (w *Worker) call(j *job, attempt int) *Call {
	c := &Call{TaskID: j.msg.ID, Key: j.key, Retries: j.msg.Retries, Attempt: attempt, Message: j.msg,
		Node: w.cfg.Hostname, retry: j.h.retry}
	if j.key != "" {
		c.Reference = reference(j.h.name, j.key)
	}
	return c
}

func (w *Worker) claimParams(j *job) idempotency.ClaimParams {
	lease := j.h.lease
	if lease <= 0 {
		lease = w.cfg.Lease
	}
	return idempotency.ClaimParams{Task: j.h.name, Key: j.key, Fingerprint: j.fp, Owner: w.cfg.Hostname,
		TaskID: j.msg.ID, Lease: lease, AllowMismatch: j.h.allowMismatch}
}

// runPure runs a task without a record. Its crash points are before the
// run (after_claim: there is no claim) and after it returns (after_effect).
func (w *Worker) runPure(ctx context.Context, j *job) {
	w.crash(workerhooks.AfterClaim, j)
	res, err := w.execute(ctx, j, w.call(j, 0), func(ctx context.Context, c *Call) (any, error) {
		return j.h.run(ctx, c, j.args)
	})
	w.crash(workerhooks.AfterEffect, j)
	if errors.Is(err, errRevokedWaiting) {
		w.revokeDelivery(ctx, j, false)
		return
	}
	if w.shutdownCut(ctx, err) {
		w.giveBack(j)
		return
	}
	w.finish(ctx, j, res, err)
}

// runSameDB claims, runs the effect and completes in one transaction.
func (w *Worker) runSameDB(ctx context.Context, j *job) {
	if !w.countRedelivery(ctx, j) {
		return
	}
	p := w.claimParams(j)
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
		var ttx pgx.Tx = &taskTx{Tx: tx}
		var guard *txGuard
		if w.hardLimit(j) > 0 {
			// The task may be abandoned at its hard time limit while it still
			// holds tx: the guard keeps it off the connection from then on.
			guard = newTxGuard()
			ttx = &guardedTx{g: guard, tx: ttx}
		}
		out, err := w.execute(ctx, j, w.call(j, 0), func(ctx context.Context, c *Call) (any, error) {
			return j.h.runTx(ctx, ttx, c, j.args)
		})
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
	case ran && errors.Is(taskErr, errRevokedWaiting):
		w.revokeDelivery(ctx, j, false) // rolled back with its claim: nothing ran
	case ran && taskErr != nil:
		if w.shutdownCut(ctx, taskErr) {
			w.giveBack(j)
			return
		}
		if !j.abandoned && dbFault(taskErr, connClosed) {
			// The database failed the transaction, not the task: nothing
			// committed; run it again after a pause.
			w.recordTrouble(ctx, j, "same-database transaction (task)", taskErr)
			return
		}
		w.finish(ctx, j, nil, taskErr)
	case err != nil && taskCaused(err):
		// The task's own work failed its transaction (a deferred
		// constraint at commit, a statement error it caught, a transaction
		// it ended itself), or the database refuses its result: nothing
		// committed (a transaction the task committed itself is held), and
		// it fails like any task error, retried as its policy says.
		w.log.Warn("the task's transaction failed by its own work", w.fields(j, zap.Error(err))...)
		w.finish(ctx, j, nil, settle(j, nil, err))
	case err != nil:
		w.recordTrouble(ctx, j, "same-database transaction", err)
	default:
		w.answerClaim(ctx, j, claim)
	}
}

// taskCaused reports whether an error of the record's RunTx belongs to the
// task's own work: a *idempotency.TaskTxError, or a definite refusal (the
// task's result is one the database cannot store).
func taskCaused(err error) bool {
	var te *idempotency.TaskTxError
	return errors.As(err, &te) || idempotency.IsDefinite(err)
}

// answerClaim acts on a claim outcome other than a run of our own, or on
// the completed claim of a same-database run in this delivery.
func (w *Worker) answerClaim(ctx context.Context, j *job, claim idempotency.Claim) {
	switch claim.Outcome {
	case idempotency.OutcomeFirst:
		// same-database: ran and committed here. The result as the record
		// keeps it, so that this caller and a duplicate's get the same.
		w.finish(ctx, j, claim.Result, nil)
	case idempotency.OutcomeCompleted:
		w.duplicate(ctx, j, claim.Result)
	case idempotency.OutcomeStale:
		// Only a same-database task whose own statement committed the
		// claim without its completion leaves one (an outside task's goes
		// to its policy before this): its effect may have committed with
		// it, and a person decides.
		w.holdSameDB(ctx, j, claim)
	case idempotency.OutcomeInProgress:
		w.deferDelivery(j, claim.LeaseUntil)
	case idempotency.OutcomeMismatch:
		w.log.Warn("fingerprint mismatch: same operation key, different arguments", w.fields(j)...)
		err := fmt.Errorf("operation %s of task %s was recorded with different arguments", j.key, j.h.name)
		exc := &celeryproto.Exception{Type: "ValueError", Module: "builtins", Message: "idempotency: " + err.Error()}
		if w.replyFailure(ctx, j, exc, err) {
			w.quarantine(ctx, j, ReasonMismatch, err)
		}
	case idempotency.OutcomeHeld:
		w.m.held.WithLabelValues(j.h.name).Inc()
		w.log.Warn("operation is held for a person to resolve; caller answered OperationHeld, its message is kept in the record",
			w.fields(j)...)
		// The caller would otherwise wait for a result that comes only if a
		// person resolves the operation: it gets a FAILURE saying so.
		exc := &celeryproto.Exception{Type: "OperationHeld", Module: "onceler.exceptions",
			Message: "operation held after a stale claim: its effect may or may not have happened; resolve it with '" + w.cfg.Program + " resolve'"}
		if w.replyFailure(ctx, j, exc, errors.New(exc.Message)) {
			w.ack(j)
		}
	case idempotency.OutcomeSkipped:
		w.log.Warn("operation was skipped by its stale-claim policy", w.fields(j)...)
		exc := &celeryproto.Exception{Type: "OperationSkipped", Module: "onceler.exceptions",
			Message: "operation skipped after a stale claim (policy skip)"}
		if w.replyFailure(ctx, j, exc, errors.New(exc.Message)) {
			w.ack(j)
		}
	default:
		w.recordTrouble(ctx, j, "claim", fmt.Errorf("unexpected claim outcome %v", claim.Outcome))
	}
}

// duplicate answers a delivery of an operation already completed: the stored
// result to this delivery's caller, then ack.
func (w *Worker) duplicate(ctx context.Context, j *job, stored []byte) {
	w.m.duplicates.WithLabelValues(j.h.name).Inc()
	if ce := w.log.Check(zap.DebugLevel, "duplicate suppressed"); ce != nil {
		ce.Write(w.fields(j)...)
	}
	if w.wantEvents() {
		w.event(ctx, j, succeededEvent(stored, 0, true))
	}
	if !w.followUp(ctx, j, stored) || !w.replySuccess(ctx, j, stored) {
		return
	}
	w.ack(j)
}

// deferDelivery keeps the delivery unacknowledged and looks at it again
// soon: first quickly (the owner is usually about to finish), then at most
// every second, and right after the lease would lapse.
func (w *Worker) deferDelivery(j *job, leaseUntil time.Time) {
	if j.checks == 0 {
		w.m.deferred.WithLabelValues(j.h.name).Inc()
	}
	delay := min(10*time.Millisecond<<min(j.checks, 7), time.Second)
	if until := time.Until(leaseUntil) + 10*time.Millisecond; !leaseUntil.IsZero() && until > 0 && until < delay {
		delay = until
	}
	if time.Since(j.received) > w.cfg.Lease {
		w.warnStall(stallInFlight, "operation claimed by another delivery still in progress; delivery kept until that claim ends or its lease lapses", j, zap.Time("lease_until", leaseUntil))
	}
	j.checks++
	j.waiting = true
	w.later(j, delay)
}

// holdSameDB holds the stale claim of a same-database operation and
// answers the delivery as held.
func (w *Worker) holdSameDB(ctx context.Context, j *job, stale idempotency.Claim) {
	p := w.claimParams(j)
	p.Message = w.heldCopy(j)
	w.m.stale.WithLabelValues(j.h.name, PolicyHold.String()).Inc()
	w.log.Warn("same-database claim committed without its completion: held", w.fields(j)...)
	c, err := w.store.ApplyPolicy(ctx, p, stale, idempotency.StalePolicy{Policy: PolicyHold,
		Reason: "same-database claim committed without its completion (the task ended its transaction)"})
	if err != nil {
		w.recordTrouble(ctx, j, "hold", err)
		return
	}
	if c.Outcome == idempotency.OutcomeStale {
		w.deferDelivery(j, c.LeaseUntil)
		return
	}
	w.answerClaim(ctx, j, c)
}

// recordTrouble handles a record error: the outcome is unknown or the
// database is away, so the delivery is not acknowledged; it is looked at
// again after a pause. A definite refusal (idempotency.IsDefinite: the
// message's content is what the database refuses) is not tried again: the
// caller is answered and the delivery quarantined.
func (w *Worker) recordTrouble(ctx context.Context, j *job, what string, err error) {
	if idempotency.IsDefinite(err) {
		w.refuse(ctx, j, what, err)
		return
	}
	if ctx.Err() != nil {
		w.giveBack(j)
		return
	}
	if schemaMissing(err) {
		w.warnStall(stallSchema, "record schema missing: run '"+w.cfg.Program+" migrate'; delivery kept and retried later", j, zap.String("step", what), zap.String("error", clip.String(err.Error(), maxLogField)))
	} else {
		w.warnStall(stallRecord, "record unavailable; delivery kept and retried later", j, zap.String("step", what), zap.String("error", clip.String(err.Error(), maxLogField)))
	}
	j.checks++
	w.later(j, min(100*time.Millisecond<<min(j.checks, 5), 2*time.Second))
}

// refuse answers a delivery whose record write the database refused for
// its content (a definite error, before any effect ran: a claim) with
// FAILURE onceler.exceptions.RecordRefused, and quarantines it.
func (w *Worker) refuse(ctx context.Context, j *job, what string, err error) {
	w.log.Error("the record refused this message's operation; quarantined", w.fields(j, zap.String("step", what), zap.Error(err))...)
	exc := &celeryproto.Exception{Type: "RecordRefused", Module: "onceler.exceptions",
		Message: "the idempotency record refused the operation: " + err.Error()}
	if w.replyFailure(ctx, j, exc, err) {
		w.quarantine(ctx, j, ReasonRefused, err)
	}
}

// shutdownCut reports whether err is the task's answer to the worker's
// grace period running out: then nothing is recorded or acknowledged.
func (w *Worker) shutdownCut(ctx context.Context, err error) bool {
	return err != nil && errors.Is(context.Cause(ctx), ErrShutdown)
}
