package tasks

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testkit"
)

// TestRevokeTerminateAbandons: a task that ignores its context is abandoned
// by Revoke(ids, true) as at the hard time limit: its caller gets REVOKED
// (TaskRevokedError "terminated") within the settle time while the task still
// runs, and the delivery is acknowledged. An outside claim is held at once
// by its policy (hold), a same-database transaction (time-limited
// task: guarded) rolled back; a same-database task without a time limit
// (no transaction guard) is waited for, and its outcome stands.
func TestRevokeTerminateAbandons(t *testing.T) {
	e := newEnv(t)
	release, releaseTx := make(chan struct{}), make(chan struct{})
	var returned atomic.Int32
	block := func(ch chan struct{}) {
		<-ch // ignores its context
		returned.Add(1)
	}
	reg := NewRegistry()
	key := func(a payArgs) (string, error) { return a.OrderID, nil }
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(Register(reg, Task[payArgs]{Name: "x.pure", Run: func(context.Context, *Call, payArgs) (any, error) { block(release); return 1, nil }}))
	must(Register(reg, Task[payArgs]{Name: "x.outside", Mode: ModeOutside, Key: key,
		Run: func(context.Context, *Call, payArgs) (any, error) { block(release); return 1, nil }}))
	must(Register(reg, Task[payArgs]{Name: "x.samedb", Mode: ModeSameDB, Key: key,
		RunTx: func(context.Context, pgx.Tx, *Call, payArgs) (any, error) { block(releaseTx); return 1, nil }}))
	must(Register(reg, Task[payArgs]{Name: "x.samedb_tl", Mode: ModeSameDB, Key: key, TimeLimit: time.Minute,
		RunTx: func(context.Context, pgx.Tx, *Call, payArgs) (any, error) { block(release); return 1, nil }}))
	cfg := e.config()
	cfg.Lease = 30 * time.Second
	cfg.Pool = testenvPool(t)
	r := e.start(reg, cfg)
	defer close(release)
	replyTo, replies := e.replyQueue()

	terminate := func(m *celeryprotoMessage) time.Duration {
		t.Helper()
		e.publish(m)
		testkit.WaitFor(t, m.Task+" running", 10*time.Second, func() bool {
			for _, a := range r.w.Active() {
				if a.ID == m.ID {
					return true
				}
			}
			return false
		})
		start := time.Now()
		r.w.Revoke([]string{m.ID}, true)
		return time.Since(start)
	}
	wantRevoked := func(got map[string]any) {
		t.Helper()
		if got["status"] != "REVOKED" || fmt.Sprint(got["result"]) != "map[exc_message:[terminated] exc_module:celery.exceptions exc_type:TaskRevokedError]" {
			t.Errorf("terminated: %v", got)
		}
	}
	for i, task := range []string{"x.pure", "x.outside", "x.samedb_tl"} {
		m := payMessage(task, i, fmt.Sprintf("o-%d", i), replyTo)
		terminate(m)
		start := time.Now()
		got := results(t, replies, 1, 10*time.Second)[m.ID]
		took := time.Since(start)
		wantRevoked(got[0])
		t.Logf("%s: REVOKED %s after the revoke, task still running: %v", task, took, returned.Load() == 0)
		if took > 2*time.Second || returned.Load() != 0 {
			t.Errorf("%s: answered after %s (task returned %d): not abandoned", task, took, returned.Load())
		}
	}
	testkit.WaitFor(t, "queue empty", 10*time.Second, func() bool { return e.queueDepth(e.queue) == 0 })
	rec, err := e.store.Get(context.Background(), "x.outside", "o-1")
	if err != nil || rec.Status != idempotency.StatusHeld {
		t.Errorf("outside record %v (%v), want held at once by its policy (hold)", rec.Status, err)
	}
	if _, err := e.store.Get(context.Background(), "x.samedb_tl", "o-2"); err == nil {
		t.Error("same-database claim kept after the abandoned task's rollback")
	}
	if len(r.w.Active()) != 0 {
		t.Errorf("abandoned tasks still listed active: %+v", r.w.Active())
	}

	// Same-database without a time limit: waited for.
	m := payMessage("x.samedb", 5, "o-5", replyTo)
	terminate(m)
	select {
	case got := <-replies:
		t.Fatalf("same-database task answered while it still runs: %v", got)
	case <-time.After(500 * time.Millisecond):
	}
	close(releaseTx)
	// It returned success despite the revoke: the outcome stands (committed
	// and answered), as it really happened.
	got := results(t, replies, 1, 10*time.Second)[m.ID]
	if got[0]["status"] != "SUCCESS" {
		t.Errorf("same-database task that returned success after the revoke: %v", got[0])
	}
	if rec, err := e.store.Get(context.Background(), "x.samedb", "o-5"); err != nil || rec.Status != idempotency.StatusCompleted {
		t.Errorf("same-database record %v (%v), want completed", rec.Status, err)
	}
}
