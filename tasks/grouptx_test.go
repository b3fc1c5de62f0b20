package tasks

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// TestGroupTxAnswersTheLastCall: a transaction group may call a
// same-database task's function twice (the group's first run rolled back
// when a member failed, then each member again in a savepoint). Here every
// operation's first call fails and its second succeeds: the caller's answer
// must be the outcome that committed (SUCCESS where the record completed,
// FAILURE where it rolled back), never the failure of a call that was rolled back.
func TestGroupTxAnswersTheLastCall(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	store := e.storeOn(testenv.Pool(t), idempotency.BatchConfig{GroupTx: 16, GroupFlushers: 1})
	var mu sync.Mutex
	calls := map[string]int{}
	reg := NewRegistry()
	if err := Register(reg, Task[payArgs]{Name: "t.flap", Mode: ModeSameDB,
		Key: func(a payArgs) (string, error) { return a.OrderID, nil },
		RunTx: func(ctx context.Context, tx pgx.Tx, c *Call, a payArgs) (any, error) {
			mu.Lock()
			calls[a.OrderID]++
			n := calls[a.OrderID]
			mu.Unlock()
			time.Sleep(2 * time.Millisecond) // let the group fill
			if n == 1 {
				return nil, errors.New("first call fails")
			}
			return map[string]any{"order": a.OrderID}, nil
		}}); err != nil {
		t.Fatal(err)
	}
	cfg := e.config()
	cfg.Store = store
	cfg.Concurrency, cfg.Prefetch = 16, 64
	e.start(reg, cfg)
	replyTo, replies := e.replyQueue()
	const n = 120
	for i := range n {
		e.publish(payMessage("t.flap", i, fmt.Sprintf("flap-%d", i), replyTo))
	}
	res := results(t, replies, n, 60*time.Second)
	twice := 0
	for i := range n {
		key := fmt.Sprintf("flap-%d", i)
		// A failed same-database run leaves no record: its transaction
		// rolled back.
		rec, err := store.Get(context.Background(), "t.flap", key)
		if errors.Is(err, idempotency.ErrNotFound) {
			rec.Status = idempotency.StatusFailed
		} else if err != nil {
			t.Fatalf("record %s: %v", key, err)
		}
		mu.Lock()
		c := calls[key]
		mu.Unlock()
		if c == 2 && rec.Status == idempotency.StatusCompleted {
			twice++
		}
		want := map[idempotency.Status]string{idempotency.StatusCompleted: "SUCCESS", idempotency.StatusFailed: "FAILURE"}[rec.Status]
		if r := res[taskID(i)]; len(r) != 1 || r[0]["status"] != want {
			t.Errorf("%s: record %s after %d calls, caller answered %v", key, rec.Status, c, r)
		}
	}
	t.Logf("%d of %d operations completed on their second call", twice, n)
	if twice == 0 {
		t.Fatal("no operation was called twice by its group: the test did not reach the case it checks")
	}
	testkit.WaitFor(t, "queue empty", 10*time.Second, func() bool { return e.queueDepth(e.queue) == 0 })
}
