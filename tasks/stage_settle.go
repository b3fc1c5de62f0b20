package tasks

// Stage 6, settle. Receives an outside task's outsideRun and the outcome the
// run stage handed on. Writes the outcome to the record with the claim's
// token: complete (the result), fail, release (a retry, or a run that never
// started), lapse (cut off by the shutdown), or hold when the effect's
// outcome is unknown or its result cannot be stored, keeping a copy of the
// message to replay (DecodeHeld). The write is retried while the database
// does not answer; the recorded outcome goes on to the answer stage.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/pause"
)

// settle records the task's outcome (res or taskErr, and whether the lease
// was lost while it ran) with the claim's token and hands it on to the
// answer stage (finish). An outcome the record cannot take (the claim taken
// over, the result refused) is answered here.
func (o *outsideRun) settle(ctx context.Context, res []byte, taskErr error, leaseLost bool) {
	w, j := o.w, o.j
	switch {
	case errors.Is(taskErr, errRevokedWaiting):
		// It never ran: the claim is released, the caller told REVOKED.
		if err := o.write(ctx, "release", func(c context.Context) error { return w.store.Release(c, o.ref) }, nil); err == nil || errors.Is(err, idempotency.ErrFenced) {
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
		err := o.write(ctx, "complete", func(c context.Context) (err error) {
			stored, err = w.store.Complete(c, o.ref, res)
			return err
		}, func(c context.Context) (err error) {
			if err := w.store.Rewrite(c, o.ref, idempotency.Rewritten{Status: idempotency.StatusCompleted, Result: res}); err != nil {
				return err
			}
			stored = nil
			if res != nil {
				stored, err = idempotency.StorableJSON(res) // as Rewrite stored it
			}
			return err
		})
		switch {
		case err == nil:
			j.completed = true
			w.finish(ctx, j, stored, nil)
		case errors.Is(err, idempotency.ErrFenced):
			w.log.Warn("claim was taken over before completion; result discarded", w.fields(j)...)
			w.deferDelivery(j, time.Time{})
		case idempotency.IsDefinite(err):
			// The effect happened, but the database refuses its result:
			// held for a person, the caller told so.
			o.unstorable(ctx, err)
		}
	case j.abandoned:
		// The task still runs: its outcome is unknown. Its claim goes to
		// the task's stale-claim policy now, not at a redelivery that
		// may never come: held (hold, lookup), skipped (skip) or failed
		// (retry: claimable again). The caller gets TimeLimitExceeded
		// (REVOKED after a terminating revoke) and the delivery is
		// acknowledged.
		if o.settleAbandoned(ctx) {
			w.finish(ctx, j, nil, taskErr)
		}
	case shutdownCut(ctx, taskErr):
		// Cut off by the shutdown: whether the task reached the outside
		// system is unknown. Its lease ends now, so that the redelivery goes
		// to the task's stale-claim policy (released, it would simply run
		// again); if that write fails, the lease runs out by itself.
		fctx, cancel := final(ctx)
		if err := w.store.Lapse(fctx, o.ref); err != nil {
			w.log.Warn("ending the lease after shutdown failed; it runs out by itself", w.fields(j, zap.Error(err))...)
		} else {
			w.log.Info("task cut off by shutdown: its claim is left stale for the stale-claim policy", w.fields(j)...)
		}
		cancel()
		w.giveBack(j)
	case IsRetry(taskErr):
		if err := o.write(ctx, "release", func(c context.Context) error { return w.store.Release(c, o.ref) }, nil); err == nil || errors.Is(err, idempotency.ErrFenced) {
			w.finish(ctx, j, nil, taskErr)
		}
	default:
		if err := o.write(ctx, "fail", func(c context.Context) error { return w.store.Fail(c, o.ref, taskErr.Error()) },
			func(c context.Context) error {
				return w.store.Rewrite(c, o.ref, idempotency.Rewritten{Status: idempotency.StatusFailed, Error: taskErr.Error()})
			}); err == nil || errors.Is(err, idempotency.ErrFenced) {
			w.finish(ctx, j, nil, taskErr)
		}
	}
}

// final returns the context of a final record write: not cancelled with
// the task, bounded by opTimeout.
func final(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), opTimeout)
}

// write makes a final record write for a claim this delivery holds,
// retrying while the database does not answer. When the record has lost
// the claim altogether (idempotency.ErrNotFound: a failover to a server it
// never reached, with asynchronous replication, or a record deleted), the
// outcome is written anew with rewrite (idempotency.Store.Rewrite), which
// finds a record only when another delivery has claimed the operation in
// between (ErrFenced, a claim taken over); a nil rewrite (a release: no
// record is as claimable as a released one) settles it as taken over. It
// returns nil, idempotency.ErrFenced or a definite refusal
// (idempotency.IsDefinite), which the caller acts on; any other outcome
// means the worker is stopping and the delivery was given back to the
// broker (its redelivery finds the claim, or none).
func (o *outsideRun) write(ctx context.Context, what string, op, rewrite func(context.Context) error) error {
	w, j := o.w, o.j
	rewriting := false
	for attempt := 0; ; attempt++ {
		fctx, cancel := final(ctx)
		err := op(fctx)
		cancel()
		if err == nil || errors.Is(err, idempotency.ErrFenced) || idempotency.IsDefinite(err) {
			return err
		}
		if errors.Is(err, idempotency.ErrNotFound) && !rewriting {
			if rewrite == nil {
				w.log.Warn("the record had lost this delivery's claim (as after an asynchronous failover, or a record deleted); nothing to release",
					w.fields(j, zap.String("step", what))...)
				return fmt.Errorf("%s: %w (%w)", what, idempotency.ErrFenced, err)
			}
			// Written anew from now on: the record keeps no trace of the
			// claim, so the write it missed can only be an insert.
			w.log.Warn("the record had lost this delivery's claim (as after an asynchronous failover, or a record deleted); its outcome is written anew",
				w.fields(j, zap.String("step", what))...)
			op, rewriting = rewrite, true
			continue
		}
		w.log.Warn("record write failed; retrying", w.fields(j, zap.String("step", what), zap.Error(err))...)
		if ctx.Err() != nil || !pause.For(ctx, min(50*time.Millisecond<<min(attempt, 5), 2*time.Second)) {
			w.giveBack(j)
			return fmt.Errorf("%s: %w", what, err)
		}
	}
}

// unstorable settles the claim of a task whose effect happened but
// whose result the database refuses (err): held for a person (its message
// kept to replay), and the caller answered FAILURE
// onceler.exceptions.ResultNotStored; then the delivery is acknowledged.
func (o *outsideRun) unstorable(ctx context.Context, err error) {
	w, j := o.w, o.j
	w.log.Error("the record refuses the task's result; operation held", w.fields(j, zap.Error(err))...)
	msg := w.heldCopy(j)
	reason := "the task's result could not be stored: " + err.Error()
	herr := o.write(ctx, "hold", func(c context.Context) error { return w.store.HoldOwn(c, o.ref, msg, reason) },
		func(c context.Context) error {
			return w.store.Rewrite(c, o.ref, idempotency.Rewritten{Status: idempotency.StatusHeld, Message: msg, Reason: reason})
		})
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

// settleAbandoned hands the claim of a task abandoned while it still
// runs to its stale-claim policy at once: the effect may happen yet, so
// hold and lookup hold it (a person decides; the lookup could not see an
// effect still in flight), skip skips it, and retry fails it (claimable
// again, the rare duplicate that policy accepts). The write is retried
// while the database does not answer; false means the worker is stopping
// and the delivery was given back (its redelivery finds the claim, which
// by then has lapsed into the policy).
func (o *outsideRun) settleAbandoned(ctx context.Context) bool {
	w, j := o.w, o.j
	reason := "the task was abandoned still running: its effect may or may not happen"
	msg := w.heldCopy(j)
	err := o.write(ctx, "settle abandoned", func(c context.Context) error {
		switch j.h.policy {
		case PolicySkip:
			return w.store.SkipOwn(c, o.ref, reason)
		case PolicyRetry:
			return w.store.Fail(c, o.ref, reason)
		default:
			return w.store.HoldOwn(c, o.ref, msg, reason)
		}
	}, func(c context.Context) error {
		st := idempotency.Rewritten{Status: idempotency.StatusHeld, Message: msg, Reason: reason}
		switch j.h.policy {
		case PolicySkip:
			st = idempotency.Rewritten{Status: idempotency.StatusSkipped, Reason: reason}
		case PolicyRetry:
			st = idempotency.Rewritten{Status: idempotency.StatusFailed, Error: reason}
		}
		return w.store.Rewrite(c, o.ref, st)
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

// heldMessage is the form of a delivery kept in a held record, so that it
// can be republished as it came (DecodeHeld); amqpDelivery.keep writes it.
type heldMessage struct {
	Exchange    string                  `json:"exchange"`
	RoutingKey  string                  `json:"routing_key"`
	Queue       string                  `json:"queue"`
	Publishing  *celeryproto.Publishing `json:"publishing"`
	CapturedAt  time.Time               `json:"captured_at"`
	Redelivered bool                    `json:"redelivered"`
}

// heldCopy encodes j's delivery for the held record it may go to, or keeps
// none (nil, logged) when it cannot be encoded (a header value JSON cannot
// hold): the operation is held all the same, without a message for
// 'onceler resolve --retry' to replay.
func (w *Worker) heldCopy(j *job) []byte {
	b, err := j.d.keep()
	if err != nil {
		w.log.Error("the held operation keeps no copy of its message: it cannot be encoded", w.fields(j, zap.Error(err))...)
		return nil
	}
	return b
}

// DecodeHeld reads the message kept in a held record (idempotency
// Record.Message, or what ResolveRetry returns) back into what to publish
// to replay it: the default exchange ("") and the queue it was consumed
// from as the routing key, as the worker's own copies go, whatever
// exchange it came by (the exchange and routing key it came by when no
// queue is kept); and the message. Header values come back as JSON gives
// them (numbers as float64).
func DecodeHeld(b []byte) (exchange, routingKey string, p *celeryproto.Publishing, err error) {
	var h heldMessage
	if err := json.Unmarshal(b, &h); err != nil {
		return "", "", nil, fmt.Errorf("decode held message: %w", err)
	}
	if h.Publishing == nil {
		return "", "", nil, fmt.Errorf("decode held message: no message")
	}
	if h.Queue != "" {
		return "", h.Queue, h.Publishing, nil
	}
	return h.Exchange, h.RoutingKey, h.Publishing, nil
}
