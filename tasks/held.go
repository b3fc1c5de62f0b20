package tasks

// Held back by the claim stage: a delivery whose operation another run has
// claimed and not finished stays unacknowledged (deferDelivery) and is
// looked at again (recheck) until the record has that run's outcome or its
// lease lapses; then it goes back through the claim stage (stage_claim.go).

import (
	"context"
	"errors"
	"time"

	"go.uber.org/zap"

	"github.com/onceler/onceler/idempotency"
)

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

// recheck looks at the record of an operation found in progress earlier,
// without claiming (a claim would count the delivery as a duplicate again).
// It answers the delivery and returns false when the record says what to
// do; true means claim again (the owner failed, released or went stale).
func (o *outsideRun) recheck(ctx context.Context) bool {
	w, j := o.w, o.j
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
