package tasks

// Stage 3, due. Receives a bound job. Hands on a job that is to run now. A
// revoked or expired message is answered REVOKED (revokeDelivery,
// stage_answer.go); one whose ETA (a countdown) is ahead is held
// unacknowledged until then, the prefetch window grown by one meanwhile, and
// comes back to the start of the pipeline when it is due. A hold longer than
// Config.MaxHold ends with the message republished and the delivery
// acknowledged.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/idempotency"
)

// due answers a revoked or expired delivery (REVOKED) and holds one whose
// ETA is ahead; it reports whether the delivery is to run now.
func (w *Worker) due(ctx context.Context, j *job) bool {
	msg := j.msg
	if w.isRevoked(msg.ID) {
		w.revokeDelivery(ctx, j, false)
		return false
	}
	if expired(msg) {
		if !w.expiredFromRecord(ctx, j) {
			w.revokeDelivery(ctx, j, true)
		}
		return false
	}
	if !msg.ETA.IsZero() {
		if wait := time.Until(msg.ETA); wait > 0 {
			if j.rehold {
				w.rehold(ctx, j)
				return false
			}
			w.schedule(j, wait)
			return false
		}
	}
	return true
}

// expiredFromRecord answers an expired redelivery from the record when a
// run of it began before the expiry: a completed operation by its stored
// result and workflow steps (duplicate), one still running (a
// same-database transaction in progress, a live claim) by waiting for its
// outcome. It reports false when the record has nothing of it (or the task
// has no record): the delivery is answered REVOKED.
func (w *Worker) expiredFromRecord(ctx context.Context, j *job) bool {
	if !j.d.redelivered() || w.store == nil || j.h.mode == ModePure || w.cfg.hooks.NoRecord {
		return false
	}
	for probed := false; ; probed = true {
		rec, err := w.store.Get(ctx, j.h.name, j.key)
		switch {
		case err == nil && rec.Status == idempotency.StatusCompleted:
			w.duplicate(ctx, j, rec.Result)
			return true
		case err == nil && rec.Status == idempotency.StatusClaimed:
			w.deferDelivery(j, rec.LeaseUntil)
			return true
		case err == nil:
			return false
		case !errors.Is(err, idempotency.ErrNotFound):
			w.recordTrouble(ctx, j, "expiry check", err)
			return true
		case probed:
			return false
		}
		// No record: a same-database run may hold its claim uncommitted.
		// Once it is not running, the record is read again (it may have
		// committed in between).
		switch running, err := w.store.Running(ctx, j.h.name, j.key); {
		case err != nil:
			w.recordTrouble(ctx, j, "expiry check", err)
			return true
		case running:
			w.deferDelivery(j, time.Time{})
			return true
		}
	}
}

// expired reports whether msg's expiry has passed.
func expired(msg *celeryproto.Message) bool {
	return !msg.Expires.IsZero() && time.Now().After(msg.Expires)
}

// schedule holds a delivery unacknowledged until its ETA, growing the
// prefetch window by one for each held delivery so that they do not starve
// the others (as Celery does).
func (w *Worker) schedule(j *job, wait time.Duration) {
	if exp := j.msg.Expires; !exp.IsZero() && exp.Before(j.msg.ETA) {
		// It expires before it is due: answer it (REVOKED) when it expires.
		wait = min(wait, time.Until(exp)+time.Millisecond)
	}
	if mh := w.cfg.MaxHold; mh > 0 && wait > mh {
		wait, j.rehold = mh, true
	}
	w.mu.Lock()
	w.held[j] = struct{}{}
	w.scheduled++
	w.mu.Unlock()
	w.m.scheduled.Inc()
	w.applyPrefetch()
	w.laterThen(j, wait, func() {
		if w.unhold(j) {
			w.applyPrefetch()
		}
	})
}

// rehold sends a delivery due later back to its queue: its hold reached
// Config.MaxHold before its ETA, it made room in the memory budget for a
// waiting delivery (j.evicted), or the held deliveries fill their half of
// the budget (decoded). A copy of the message goes back to the queue it
// came from (republishHeld), then the delivery is acknowledged; the copy
// arrives as a fresh delivery and is held in its place. A crash in between
// leaves two copies with the same task id: the record answers the second.
func (w *Worker) rehold(ctx context.Context, j *job) {
	msg := "held delivery republished (max hold reached before its ETA, or the held half of the memory budget full)"
	if j.evicted {
		msg = "held delivery republished (room made in the memory budget for a waiting delivery)"
	}
	w.republishHeld(ctx, j, msg)
}

// republishHeld puts a copy of j's message back on the queue it came from
// (delivery.republish; the AMQP transport: default exchange, confirmed),
// then acknowledges the delivery; msg is the debug log line.
func (w *Worker) republishHeld(ctx context.Context, j *job, msg string) {
	if err := j.d.republish(ctx, j.msg.ETA); err != nil {
		if amqp.IsPermanent(err) {
			w.publishRefused(ctx, j, fmt.Errorf("republish held delivery: %w", err))
			return
		}
		w.recordTrouble(ctx, j, "republish held delivery", err)
		return
	}
	if ce := w.log.Check(zap.DebugLevel, msg); ce != nil {
		ce.Write(w.fields(j, zap.Time("eta", j.msg.ETA))...)
	}
	w.ack(j)
}

// unhold removes j from the held set; it reports whether j was there.
func (w *Worker) unhold(j *job) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if _, ok := w.held[j]; !ok {
		return false
	}
	delete(w.held, j)
	w.scheduled--
	w.m.scheduled.Dec()
	return true
}

// applyPrefetch sets the transport's prefetch window to Config.Prefetch plus the
// deliveries held for their ETA. Calls are serialized and each applies the
// count of its time, so the last one wins with the latest count.
func (w *Worker) applyPrefetch() {
	w.qosMu.Lock()
	defer w.qosMu.Unlock()
	w.mu.Lock()
	n := w.cfg.Prefetch + w.scheduled
	w.mu.Unlock()
	if n > 65535 {
		n = 65535
	}
	if err := w.tr.setPrefetch(n); err != nil {
		w.log.Warn("set prefetch for ETA deliveries", zap.Int("prefetch", n), zap.Error(err))
	}
}

// dropStaleHeld forgets deliveries held for their ETA whose channel is gone
// (a reconnect, or the broker closing the channel at its consumer_timeout):
// the broker redelivers them, and their copies are held instead; the
// prefetch window shrinks back.
func (w *Worker) dropStaleHeld() {
	dropped := 0
	w.mu.Lock()
	for j := range w.held {
		if !j.d.stale() {
			continue
		}
		if t, ok := w.timers[j]; ok {
			t.Stop()
			delete(w.timers, j)
		}
		delete(w.held, j)
		delete(w.reserved, j)
		w.scheduled--
		w.m.scheduled.Dec()
		dropped++
	}
	w.mu.Unlock()
	if dropped > 0 {
		w.log.Info("held ETA deliveries lost with their channel; the broker redelivers them", zap.Int("count", dropped))
		w.applyPrefetch()
	}
}
