package tasks

import (
	"context"
	"time"

	"go.uber.org/zap"
)

// Ready reports whether the worker is consuming, its database answers and
// it is not stalled (Stalled).
func (w *Worker) Ready() bool {
	return w.ready(context.Background())
}

// Stalled reports whether the worker holds every slot without progress:
// every task goroutine busy, or the deliveries it holds (those held for
// their ETA aside) filling the prefetch window, or deliveries waiting for
// room in the memory budget, and that for Config.StallAfter without a
// delivery settled (acknowledged, given back or lost with its channel). It
// is looked at four times a second and ends with the next delivery
// settled.
func (w *Worker) Stalled() bool { return w.stalledNow.Load() }

// checkStall updates Stalled; full is when the slots were last found all
// held (0: they were not).
func (w *Worker) checkStall(full *time.Time) {
	w.mu.Lock()
	slots := len(w.reserved) + len(w.active) - len(w.held)
	waiting := len(w.waiting)
	w.mu.Unlock()
	now := time.Now()
	if int(w.busy.Load()) < w.PoolSize() && slots < w.cfg.Prefetch && waiting == 0 {
		*full = time.Time{}
	} else if full.IsZero() {
		*full = now
	}
	since := time.Unix(0, w.settled.Load())
	if full.After(since) {
		since = *full
	}
	stalled := !full.IsZero() && now.Sub(since) >= w.cfg.StallAfter
	if w.stalledNow.Swap(stalled) != stalled {
		if stalled {
			w.m.stalled.Set(1)
			w.log.Warn("stalled: every slot is held and no delivery was settled; not ready", zap.Duration("for", now.Sub(since)),
				zap.Int32("busy", w.busy.Load()), zap.Int("held_deliveries", slots), zap.Int("waiting_for_memory", waiting))
		} else {
			w.m.stalled.Set(0)
			w.log.Info("progress again: ready")
		}
	}
}

func (w *Worker) ready(ctx context.Context) bool {
	if !w.running.Load() || w.draining.Load() || !w.tr.ready() || w.Stalled() {
		return false
	}
	if w.cfg.Pool != nil && w.store != nil {
		ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		if err := w.cfg.Pool.Ping(ctx); err != nil {
			return false
		}
	}
	return true
}
