package tasks

import (
	"context"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/onceler/onceler/internal/workerhooks"
)

// runOwnTx runs a same-database task without the record (workerhooks
// NoRecord): its RunTx gets a transaction of its own on Config.Pool,
// committed when it succeeds, rolled back when it fails. Nothing is
// recorded: every delivery repeats the effect, which is what a run without
// the record shows.
func (w *Worker) runOwnTx(ctx context.Context, j *job) {
	tx, err := w.cfg.Pool.Begin(ctx)
	if err != nil {
		w.recordTrouble(ctx, j, "begin", err)
		return
	}
	w.crash(workerhooks.AfterClaim, j)
	ttx, guard := taskTxOf(j, tx)
	res, taskErr := w.execute(ctx, j, w.call(j, 0), func(ctx context.Context, c *Call) (any, error) {
		return j.h.runTx(ctx, ttx, c, j.args)
	}, nil)
	if j.abandoned && guard != nil && guard.abandon(tx, time.Second) {
		w.log.Warn("abandoned task kept its query running: connection closed to roll its transaction back", w.fields(j)...)
	}
	if taskErr != nil {
		connClosed := tx.Conn().IsClosed()
		rctx, cancel := final(ctx)
		if err := tx.Rollback(rctx); err != nil {
			w.log.Debug("rollback after the task failed", w.fields(j, zap.Error(err))...)
		}
		cancel()
		w.taskTxFailed(ctx, j, taskErr, connClosed, "own transaction (task)")
		return
	}
	w.crash(workerhooks.AfterEffect, j)
	cctx, cancel := final(ctx)
	err = tx.Commit(cctx)
	cancel()
	if err != nil {
		// The effect may or may not have committed: the delivery stays
		// unacknowledged and runs again (without the record, a repeat is
		// what this mode shows).
		w.recordTrouble(ctx, j, "commit", fmt.Errorf("commit the task's own transaction: %w", err))
		return
	}
	w.finish(ctx, j, res, nil)
}

// wantEvents reports whether task events go to the Observer now: there is
// one, and it has no TaskEvents method or that says yes. Event field maps
// are built only after it said yes.
func (w *Worker) wantEvents() bool {
	if w.obs == nil {
		return false
	}
	return w.taskEvents == nil || w.taskEvents()
}
