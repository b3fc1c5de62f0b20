package tasks

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/onceler/onceler/idempotency"
)

// TestLeaseLostCancelsTheTask: when the heartbeat cannot renew a running
// task's claim (here another token fenced it), the task's context is
// cancelled with cause idempotency.ErrLeaseLost, nothing is recorded for
// the delivery (the record keeps the other token) and it is not
// acknowledged; a task that ends before its first renewal is unaffected.
func TestLeaseLostCancelsTheTask(t *testing.T) {
	e := newEnv(t)
	causes := make(chan error, 4)
	reg := NewRegistry()
	key := func(a payArgs) (string, error) { return a.OrderID, nil }
	if err := Register(reg, Task[payArgs]{Name: "x.hang", Mode: ModeOutside, Key: key,
		Run: func(ctx context.Context, _ *Call, a payArgs) (any, error) {
			if a.Amount == 0 {
				return "quick", nil
			}
			select {
			case <-ctx.Done():
				causes <- context.Cause(ctx)
				return nil, context.Cause(ctx)
			case <-time.After(20 * time.Second):
				causes <- nil
				return "not cancelled", nil
			}
		}}); err != nil {
		t.Fatal(err)
	}
	cfg := e.config()
	cfg.Lease = 900 * time.Millisecond // first renewal after 300 ms
	r := e.start(reg, cfg)
	replyTo, replies := e.replyQueue()

	quick := payMessage("x.hang", 1, "quick", replyTo)
	quick.Kwargs["amount"] = int64(0)
	e.publish(quick)
	if got := results(t, replies, 1, 10*time.Second)[quick.ID]; len(got) != 1 || got[0]["status"] != "SUCCESS" {
		t.Fatalf("quick task: %v", got)
	}

	m := payMessage("x.hang", 2, "hang", replyTo)
	e.publish(m)
	waitActive(t, r, m.ID)
	ctx := context.Background()
	// Another run's claim, live for the rest of the test: were its lease to
	// lapse meanwhile, the kept delivery would meet a stale claim and be
	// answered by the task's policy.
	if _, err := testenvPool(t).Exec(ctx, `UPDATE `+e.schema+`.records SET token = 'fenced', lease_until = now() + interval '1 hour' WHERE key = 'hang'`); err != nil {
		t.Fatal(err)
	}
	select {
	case cause := <-causes:
		if !errors.Is(cause, idempotency.ErrLeaseLost) {
			t.Fatalf("task context cause %v, want ErrLeaseLost", cause)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("task not cancelled after its claim was fenced")
	}
	time.Sleep(300 * time.Millisecond)
	rec, err := e.store.Get(ctx, "x.hang", "hang")
	if err != nil {
		t.Fatal(err)
	}
	if rec.Status != idempotency.StatusClaimed || rec.Token != "fenced" {
		t.Errorf("record after a lost lease: %+v", rec)
	}
	if got := collect(replies, 1, 300*time.Millisecond); len(got) != 0 {
		t.Errorf("caller answered after a lost lease: %v", got)
	}
}

func waitActive(t *testing.T, r *running, id string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		for _, a := range r.w.Active() {
			if a.ID == id {
				return
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("task %s not running after 10s", id)
}
