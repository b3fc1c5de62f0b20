package tasks

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testkit"
)

// TestGracefulStop: stopping a worker while tasks run lets them finish and
// acknowledges them; what was waiting goes back to the queue; a second
// worker completes the rest; every operation runs once.
func TestGracefulStop(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		grace time.Duration
		ms    int64
	}{
		{"finish within grace", 10 * time.Second, 300},
		{"cancelled after grace", 100 * time.Millisecond, 3000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			fx := &effects{}
			reg := sleepRegistry(t, fx)
			cfg := e.config()
			cfg.Concurrency, cfg.Prefetch, cfg.Grace = 4, 8, tc.grace
			w1 := e.start(reg, cfg)
			replyTo, replies := e.replyQueue()
			const n = 20
			for i := range n {
				e.publish(sleepMessage(i, tc.ms, replyTo))
			}
			testkit.WaitFor(t, "4 running tasks", 10*time.Second, func() bool { return len(w1.w.Active()) == 4 })
			stopped := time.Now()
			w1.stop(t)
			t.Logf("stop took %s", time.Since(stopped).Round(time.Millisecond))
			done := len(fx.snapshot())
			if tc.ms < 1000 && done != 4 {
				t.Errorf("%d tasks finished during the grace period, want the 4 running", done)
			}
			if tc.ms >= 1000 && done != 0 {
				t.Errorf("%d tasks finished although cancelled", done)
			}
			if d := e.queueDepth(e.queue); d != n-done {
				t.Errorf("queue holds %d messages after the stop, want %d", d, n-done)
			}
			cfg2 := e.config()
			cfg2.Concurrency = 20
			e.start(reg, cfg2)
			res := make(map[string][]map[string]any)
			deadline := time.Now().Add(30 * time.Second)
			for len(res) < n && time.Now().Before(deadline) {
				select {
				case r := <-replies:
					res[r["task_id"].(string)] = append(res[r["task_id"].(string)], r)
				case <-time.After(time.Second):
				}
			}
			for i := range n {
				if r := res[taskID(i)]; len(r) == 0 || r[0]["status"] != "SUCCESS" {
					t.Errorf("task %d: %v", i, r)
				}
			}
			checkExactlyOnce(t, fx, n, func(i int) string { return fmt.Sprintf("s-%d", i) })
			testkit.WaitFor(t, "queue empty", 10*time.Second, func() bool { return e.queueDepth(e.queue) == 0 })
		})
	}
}

// TestShutdownCutLeavesClaimToPolicy: an outside task cut off by the end of
// the grace period may already have reached the outside system, so its
// claim is left stale, not released: the redelivery goes to the task's
// stale-claim policy (hold here: held, the caller told OperationHeld), and
// the effect is not repeated.
func TestShutdownCutLeavesClaimToPolicy(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := &effects{}
	reg := NewRegistry()
	started := make(chan struct{}, 1)
	if err := Register(reg, Task[payArgs]{Name: "t.mail", Mode: ModeOutside, Policy: PolicyHold,
		Key: func(a payArgs) (string, error) { return a.OrderID, nil },
		Run: func(ctx context.Context, c *Call, a payArgs) (any, error) {
			fx.add(c.Key) // the mail server took the message ...
			started <- struct{}{}
			<-ctx.Done() // ... and its answer is still on the way
			return nil, context.Cause(ctx)
		}}); err != nil {
		t.Fatal(err)
	}
	cfg := e.config()
	cfg.Grace = 100 * time.Millisecond
	w1 := e.start(reg, cfg)
	replyTo, replies := e.replyQueue()
	e.publish(payMessage("t.mail", 1, "mail-1", replyTo))
	<-started
	w1.stop(t)
	if rec, err := e.store.Get(context.Background(), "t.mail", "mail-1"); err != nil || rec.Status != idempotency.StatusClaimed || rec.LeaseUntil.After(time.Now()) {
		t.Fatalf("record after the cut: %s, lease until %v, %v; want claimed with its lease over", rec.Status, rec.LeaseUntil, err)
	}
	e.start(reg, e.config())
	r := results(t, replies, 1, 10*time.Second)[taskID(1)][0]
	if res, _ := r["result"].(map[string]any); r["status"] != "FAILURE" || res["exc_type"] != "OperationHeld" {
		t.Errorf("caller answered %v, want FAILURE OperationHeld", r)
	}
	if rec, err := e.store.Get(context.Background(), "t.mail", "mail-1"); err != nil || rec.Status != idempotency.StatusHeld {
		t.Errorf("record %s (%v), want held", rec.Status, err)
	}
	if n := fx.snapshot()["mail-1"]; n != 1 {
		t.Errorf("effect ran %d times, want 1", n)
	}
	testkit.WaitFor(t, "queue empty", 10*time.Second, func() bool { return e.queueDepth(e.queue) == 0 })
}
