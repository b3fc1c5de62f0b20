package tasks

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testkit"
)

// TestEndedThenFailedHeldWithMessage: a same-database task that commits its
// transaction itself through the raw connection (which the worker cannot
// refuse) and then fails leaves its claim and its effect committed: the
// operation is held for a person, who decides from the outside world. The
// held record keeps the delivery, so that 'onceler resolve --retry' can
// republish it; without it the person can only resolve it completed. Alone
// and in a transaction group.
func TestEndedThenFailedHeldWithMessage(t *testing.T) {
	t.Parallel()
	for _, group := range []int{0, 8} {
		t.Run(fmt.Sprintf("group%d", group), func(t *testing.T) {
			e := newEnv(t)
			pool := testenvPool(t)
			ctx := context.Background()
			table := e.schema + ".ended"
			if _, err := pool.Exec(ctx, `CREATE TABLE `+table+` (op text PRIMARY KEY)`); err != nil {
				t.Fatal(err)
			}
			r := NewRegistry()
			if err := Register(r, Task[opArgs]{Name: "eh.commit_fail", Mode: ModeSameDB, Key: opKey,
				RunTx: func(ctx context.Context, tx pgx.Tx, _ *Call, a opArgs) (any, error) {
					if _, err := tx.Exec(ctx, `INSERT INTO `+table+` VALUES ($1)`, a.Op); err != nil {
						return nil, err
					}
					if _, err := tx.Conn().Exec(ctx, "COMMIT"); err != nil {
						return nil, err
					}
					return nil, errors.New("failed after committing its effect")
				}}); err != nil {
				t.Fatal(err)
			}
			cfg := e.config()
			if group > 0 {
				cfg.Store = e.storeOn(pool, idempotency.BatchConfig{GroupTx: group})
			}
			e.start(r, cfg)
			replyTo, replies := e.replyQueue()
			e.publish(&celeryproto.Message{Protocol: 2, Task: "eh.commit_fail", ID: taskID(1), Kwargs: map[string]any{"op": "op-1"},
				ReplyTo: replyTo, CorrelationID: taskID(1)})
			res := collect(replies, 1, 10*time.Second)
			testkit.WaitFor(t, "queue empty", 10*time.Second, func() bool { return e.queueDepth(e.queue) == 0 })
			if rs := res[taskID(1)]; len(rs) != 1 || rs[0]["status"] != "FAILURE" {
				t.Fatalf("answered %v, want one FAILURE", rs)
			}
			rec, err := e.store.Get(ctx, "eh.commit_fail", "op-1")
			if err != nil {
				t.Fatal(err)
			}
			if rec.Status != idempotency.StatusHeld {
				t.Fatalf("record %s (%s), want held", rec.Status, rec.Reason)
			}
			if len(rec.Message) == 0 {
				t.Fatalf("held record (%s) keeps no message: 'resolve --retry' cannot republish it", rec.Reason)
			}
			_, _, p, err := DecodeHeld(rec.Message)
			if err != nil || p == nil {
				t.Fatalf("kept message: %v", err)
			}
		})
	}
}
