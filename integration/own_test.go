package integration

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/tasks"
)

// countOwn counts the calls a task of the replayworker binary made to its
// outside service for one operation.
func countOwn(task string) func(context.Context, *pgxpool.Pool, string) (int, error) {
	return func(ctx context.Context, pool *pgxpool.Pool, op string) (int, error) {
		var n int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM onceler_replay.effects WHERE task = $1 AND op = $2`, task, op).Scan(&n)
		return n, err
	}
}

// TestReplaySkipPolicy runs the replay suite on replay.audit, an outside
// task with the stale-claim policy skip (none of the demo tasks has it),
// with and without the record.
func TestReplaySkipPolicy(t *testing.T) {
	t.Parallel()
	tg := replay.Target{
		Binary: ownBin, Task: "replay.audit", Mode: tasks.ModeOutside, Policy: tasks.PolicySkip,
		Arguments: func(op string) ([]any, map[string]any) { return []any{op}, nil },
		Effects:   countOwn("replay.audit"),
	}
	t.Run("record", func(t *testing.T) { replay.Run(t, tg) })
	t.Run("no_record", func(t *testing.T) {
		tg.NoRecord = true
		replay.Run(t, tg)
	})
}
