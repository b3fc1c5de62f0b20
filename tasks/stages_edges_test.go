package tasks

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/internal/pause"
	"github.com/onceler/onceler/internal/testkit"
)

// TestTimeLimitTakenWhenHeldDeliveryRuns: time limits set at run time
// (SetTimeLimit) while a delivery is held for its ETA apply when the held
// delivery comes back through the pipeline and runs: the limits are taken
// on that pass (after the due and rate-limit stages), not when the delivery
// first arrived. Each mode's path (outside: claim, run, settle; same
// database: the transaction with its guard; no-record same database: its
// own transaction; pure) answers TimeLimitExceeded with the limit set at
// run time, long before the task's own 3 s.
func TestTimeLimitTakenWhenHeldDeliveryRuns(t *testing.T) {
	for _, noRecord := range []bool{false, true} {
		t.Run(fmt.Sprintf("no_record=%v", noRecord), func(t *testing.T) {
			e := newEnv(t)
			sleep := func(ctx context.Context) error {
				if !pause.For(ctx, 3*time.Second) {
					return fmt.Errorf("interrupted: %w", context.Cause(ctx))
				}
				return nil
			}
			key := func(a payArgs) (string, error) { return a.OrderID, nil }
			reg := NewRegistry()
			must := func(err error) {
				t.Helper()
				if err != nil {
					t.Fatal(err)
				}
			}
			must(Register(reg, Task[payArgs]{Name: "h.pure", Run: func(ctx context.Context, _ *Call, _ payArgs) (any, error) {
				return 1, sleep(ctx)
			}}))
			must(Register(reg, Task[payArgs]{Name: "h.samedb", Mode: ModeSameDB, Key: key,
				RunTx: func(ctx context.Context, _ pgx.Tx, _ *Call, _ payArgs) (any, error) { return 1, sleep(ctx) }}))
			tasks := []string{"h.pure", "h.samedb"}
			if !noRecord {
				must(Register(reg, Task[payArgs]{Name: "h.outside", Mode: ModeOutside, Key: key,
					Run: func(ctx context.Context, _ *Call, _ payArgs) (any, error) { return 1, sleep(ctx) }}))
				tasks = append(tasks, "h.outside")
			}
			cfg := e.config()
			cfg.Pool = testenvPool(t)
			if noRecord {
				cfg.hooks.NoRecord, cfg.Store = true, nil
			}
			r := e.start(reg, cfg)
			replyTo, replies := e.replyQueue()
			due := time.Now().Add(1500 * time.Millisecond)
			for i, task := range tasks {
				m := payMessage(task, i, fmt.Sprintf("o-%d", i), replyTo)
				m.ETA = due
				e.publish(m)
			}
			deadline := time.Now().Add(10 * time.Second)
			for len(r.w.Scheduled()) < len(tasks) {
				if time.Now().After(deadline) || time.Now().After(due) {
					t.Fatalf("deliveries not all held for their ETA before it: %d of %d", len(r.w.Scheduled()), len(tasks))
				}
				time.Sleep(10 * time.Millisecond)
			}
			for _, task := range tasks {
				must(r.w.SetTimeLimit(task, 0, 300*time.Millisecond))
			}
			res := results(t, replies, len(tasks), 15*time.Second)
			answered := time.Now()
			for i, task := range tasks {
				got := res[taskID(i)]
				if len(got) != 1 {
					t.Errorf("%s: %d answers, want 1: %v", task, len(got), got)
					continue
				}
				if got[0]["status"] != "FAILURE" || fmt.Sprint(got[0]["result"]) != "map[exc_message:[0.3] exc_module:billiard.exceptions exc_type:TimeLimitExceeded]" {
					t.Errorf("%s: %v, want FAILURE TimeLimitExceeded 0.3 (the limit set while it was held)", task, got[0])
				}
			}
			if late := answered.Sub(due); late > 2500*time.Millisecond {
				t.Errorf("answered %s after due: the 0.3 s limit did not cut the 3 s task", late)
			}
		})
	}
}

// TestTimeLimitTakenWhenDeferredDeliveryRuns: a delivery deferred because
// its operation is in progress under another delivery comes back through
// the pipeline; when that run fails (the operation claimable again) it
// claims and runs under the time limits in force then, set while it waited
// (SetTimeLimit), not those of when it arrived.
func TestTimeLimitTakenWhenDeferredDeliveryRuns(t *testing.T) {
	e := newEnv(t)
	var calls atomic.Int32
	reg := NewRegistry()
	err := Register(reg, Task[payArgs]{Name: "d.outside", Mode: ModeOutside, Policy: PolicyRetry,
		Key: func(a payArgs) (string, error) { return a.OrderID, nil },
		Run: func(ctx context.Context, _ *Call, _ payArgs) (any, error) {
			if calls.Add(1) == 1 {
				if !pause.For(ctx, time.Second) {
					return nil, context.Cause(ctx)
				}
				return nil, errors.New("first run fails")
			}
			if !pause.For(ctx, 3*time.Second) {
				return nil, fmt.Errorf("interrupted: %w", context.Cause(ctx))
			}
			return 1, nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	cfg := e.config()
	cfg.Concurrency = 2
	r := e.start(reg, cfg)
	replyTo, replies := e.replyQueue()
	e.publish(payMessage("d.outside", 0, "same-op", replyTo))
	testkit.WaitFor(t, "first run started", 10*time.Second, func() bool { return calls.Load() == 1 })
	e.publish(payMessage("d.outside", 1, "same-op", replyTo))
	testkit.WaitFor(t, "second delivery deferred", 10*time.Second, func() bool {
		return counterValue(r.w.m.deferred.WithLabelValues("d.outside")) == 1
	})
	if err := r.w.SetTimeLimit("d.outside", 0, 300*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	res := results(t, replies, 2, 15*time.Second)
	if got := res[taskID(0)]; len(got) != 1 || got[0]["status"] != "FAILURE" {
		t.Errorf("first delivery: %v, want one FAILURE", got)
	}
	got := res[taskID(1)]
	if len(got) != 1 || got[0]["status"] != "FAILURE" || fmt.Sprint(got[0]["result"]) != "map[exc_message:[0.3] exc_module:billiard.exceptions exc_type:TimeLimitExceeded]" {
		t.Errorf("deferred delivery: %v, want one FAILURE TimeLimitExceeded 0.3 (the limit set while it waited)", got)
	}
	if n := calls.Load(); n != 2 {
		t.Errorf("task ran %d times, want 2", n)
	}
}
