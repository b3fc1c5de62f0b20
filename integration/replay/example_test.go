package replay_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/tasks"
)

// countNotify counts the calls replay.notify made to its outside service
// for one operation.
func countNotify(ctx context.Context, pool *pgxpool.Pool, op string) (int, error) {
	var n int
	err := pool.QueryRow(ctx, `SELECT count(*) FROM onceler_replay.effects WHERE task = 'replay.notify' AND op = $1`, op).Scan(&n)
	return n, err
}

// TestOwnBinary points the replay suite at a task of your own in a binary
// of your own: integration/testdata/replayworker registers replay.notify
// (outside system, stale-claim policy retry) and reads its settings from the
// ONCELER_* environment variables the suite sets. With the record, every
// scenario holds the policy's guarantee; without it (ONCELER_NO_RECORD),
// every scenario must show a duplicate.
func TestOwnBinary(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	bin, err := replay.Build(ctx, t.TempDir(), "github.com/onceler/onceler/integration/testdata/replayworker")
	if err != nil {
		t.Fatal(err)
	}
	target := replay.Target{
		Binary: bin,
		Task:   "replay.notify",
		Mode:   tasks.ModeOutside,
		Policy: tasks.PolicyRetry,
		Arguments: func(op string) ([]any, map[string]any) {
			return []any{op}, nil // replay.notify(op); its operation key is op
		},
		Effects: countNotify,
	}
	t.Run("record", func(t *testing.T) { replay.Run(t, target) })
	t.Run("no_record", func(t *testing.T) {
		target.NoRecord = true
		replay.Run(t, target)
	})
}

// Example shows the test to write for a task of your own, served by a
// binary of your own that reads the ONCELER_* settings (see the package
// documentation). It names a module of yours, so here it is only compiled:
// put testReplay's body in a TestXxx of your module, where "go test" runs
// it (integration/replay_test.go does so for the demo tasks).
func Example() {
	testReplay := func(t *testing.T) {
		bin, err := replay.Build(context.Background(), t.TempDir(), "example.com/billing/cmd/worker")
		if err != nil {
			t.Fatal(err)
		}
		replay.Run(t, replay.Target{
			Binary: bin,
			Task:   "billing.refund",
			Mode:   tasks.ModeSameDB,
			Arguments: func(op string) ([]any, map[string]any) {
				return []any{op, 1250}, nil // refund(order_id, cents); key order_id
			},
			Effects: func(ctx context.Context, pool *pgxpool.Pool, op string) (int, error) {
				var n int
				err := pool.QueryRow(ctx, `SELECT count(*) FROM refunds WHERE order_id = $1`, op).Scan(&n)
				return n, err
			},
		})
	}
	_ = testReplay
}
