package integration

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/tasks"
)

func migrateDemo(ctx context.Context, pool *pgxpool.Pool) error { return demo.Migrate(ctx, pool) }

// demoTargets are the demo tasks, served by the onceler binary.
func demoTargets() []replay.Target {
	base := replay.Target{Binary: oncelerBin, Command: []string{"worker", "--migrate"}, Setup: migrateDemo}
	with := func(t replay.Target) replay.Target {
		t.Binary, t.Command, t.Setup = base.Binary, base.Command, base.Setup
		return t
	}
	return []replay.Target{
		with(replay.Target{
			Task: demo.TaskCredit, Mode: tasks.ModeSameDB,
			Arguments: func(op string) ([]any, map[string]any) { return []any{"acct-" + op, op, 125}, nil },
			Effects: func(ctx context.Context, pool *pgxpool.Pool, op string) (int, error) {
				return demo.CountLedger(ctx, pool, op)
			},
		}),
		with(replay.Target{
			Task: demo.TaskCharge, Mode: tasks.ModeOutside, Policy: tasks.PolicyLookup,
			Arguments: func(op string) ([]any, map[string]any) { return []any{op}, map[string]any{"cents": 990} },
			// Every call to the gateway: with the record exactly one, even
			// though the gateway itself would absorb a second charge.
			Effects: func(ctx context.Context, pool *pgxpool.Pool, op string) (int, error) {
				return demo.CountGatewayCalls(ctx, pool, op)
			},
		}),
		with(replay.Target{
			Task: demo.TaskEmail, Mode: tasks.ModeOutside, Policy: tasks.PolicyHold,
			Arguments: func(op string) ([]any, map[string]any) {
				return nil, map[string]any{"message_id": op, "to": "someone@example.com", "subject": "hello"}
			},
			Effects: func(ctx context.Context, pool *pgxpool.Pool, op string) (int, error) {
				return demo.CountEmailSends(ctx, pool, op)
			},
		}),
		with(replay.Target{
			Task: demo.TaskSleep, Mode: tasks.ModeSameDB,
			Arguments: func(op string) ([]any, map[string]any) { return []any{op, 0.05}, nil },
			Effects: func(ctx context.Context, pool *pgxpool.Pool, op string) (int, error) {
				return demo.CountSleeps(ctx, pool, op)
			},
		}),
		with(replay.Target{
			Task: demo.TaskAdd, Mode: tasks.ModePure,
			Arguments: func(string) ([]any, map[string]any) { return []any{2, 3}, nil },
		}),
		// No effects to count: the record, the results and the queue are
		// checked.
		with(replay.Target{
			Task: demo.TaskFlaky, Mode: tasks.ModeOutside, Policy: tasks.PolicyRetry,
			Arguments: func(op string) ([]any, map[string]any) { return []any{op, 0}, nil },
		}),
		with(replay.Target{
			Task: demo.TaskFail, Mode: tasks.ModePure, Exception: "ValueError",
			Arguments: func(string) ([]any, map[string]any) { return []any{"always"}, nil },
		}),
	}
}

// TestReplayDemo runs the replay suite on every demo task, with the record
// (every scenario must hold its guarantee) and without it (every scenario
// with effects must show the duplicate the record prevents).
func TestReplayDemo(t *testing.T) {
	t.Parallel()
	for _, tg := range demoTargets() {
		t.Run(tg.Task, func(t *testing.T) {
			t.Run("record", func(t *testing.T) { replay.Run(t, tg) })
			t.Run("no_record", func(t *testing.T) {
				tg.NoRecord = true
				replay.Run(t, tg)
			})
		})
	}
}

// TestReplayDemoGroupTx replays the same-database demo tasks with workers
// that run them in transaction groups (--group-tx): claims, effects and
// completions of several deliveries in one transaction, committed once.
// Every scenario must hold as with a transaction per task.
func TestReplayDemoGroupTx(t *testing.T) {
	t.Parallel()
	for _, tg := range demoTargets() {
		if tg.Mode != tasks.ModeSameDB {
			continue
		}
		t.Run(tg.Task, func(t *testing.T) {
			tg.Env = append(tg.Env, "ONCELER_GROUP_TX=16")
			replay.Run(t, tg)
		})
	}
}
