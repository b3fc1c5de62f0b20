package tasks

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/pause"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
	"github.com/onceler/onceler/internal/workerhooks"
)

type sleepArgs struct {
	ID string `celery:"order_id"`
	Ms int64  `celery:"amount"`
}

// sleepRegistry has "t.sleep": an outside-mode task that sleeps Ms
// milliseconds (giving up when its context ends) and then counts its effect.
func sleepRegistry(t *testing.T, fx *effects) *Registry {
	t.Helper()
	reg := NewRegistry()
	err := Register(reg, Task[sleepArgs]{
		Name: "t.sleep", Mode: ModeOutside, Policy: PolicyRetry,
		Key: func(a sleepArgs) (string, error) { return a.ID, nil },
		Run: func(ctx context.Context, c *Call, a sleepArgs) (any, error) {
			if !pause.For(ctx, time.Duration(a.Ms)*time.Millisecond) {
				return nil, fmt.Errorf("interrupted: %w", context.Cause(ctx))
			}
			fx.add(c.Key)
			return a.ID, nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	return reg
}

func sleepMessage(i int, ms int64, replyTo string) *celeryproto.Message {
	m := payMessage("t.sleep", i, fmt.Sprintf("s-%d", i), replyTo)
	m.Kwargs["amount"] = ms
	return m
}

// TestGracefulStop: stopping a worker while tasks run lets them finish and
// acknowledges them; what was waiting goes back to the queue; a second
// worker completes the rest; every operation runs once.
func TestGracefulStop(t *testing.T) {
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

// TestRevokeWhileWaiting: a task revoked after its delivery was taken up
// but before it started (here: waiting for the only database connection,
// held by another task) does not start: REVOKED, no effect, its claim gone.
func TestRevokeWhileWaiting(t *testing.T) {
	e := newEnv(t)
	pcfg, err := pgxpool.ParseConfig(testenv.DatabaseURL(t))
	if err != nil {
		t.Fatal(err)
	}
	pcfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	store := e.storeOn(pool, idempotency.BatchConfig{Disabled: true})
	fx := &effects{}
	release := make(chan struct{})
	started := make(chan string, 2)
	reg := NewRegistry()
	if err := Register(reg, Task[payArgs]{Name: "t.hold_conn", Mode: ModeSameDB,
		Key: func(a payArgs) (string, error) { return a.OrderID, nil },
		RunTx: func(_ context.Context, _ pgx.Tx, c *Call, a payArgs) (any, error) {
			started <- a.OrderID
			if a.OrderID == "first" {
				<-release // holds the pool's only connection
			}
			fx.add(c.Key)
			return a.OrderID, nil
		}}); err != nil {
		t.Fatal(err)
	}
	cfg := e.config()
	cfg.Store, cfg.Pool = store, pool
	r := e.start(reg, cfg)
	replyTo, replies := e.replyQueue()
	e.publish(payMessage("t.hold_conn", 1, "first", replyTo))
	if got := <-started; got != "first" {
		t.Fatalf("started %s first", got)
	}
	second := payMessage("t.hold_conn", 2, "second", replyTo)
	e.publish(second)
	testkit.WaitFor(t, "the second delivery taken up", 10*time.Second, func() bool {
		for _, ti := range r.w.Reserved() {
			if ti.ID == second.ID {
				return true
			}
		}
		return false
	})
	// Past the revoke check at its start, it waits for the connection.
	time.Sleep(300 * time.Millisecond)
	r.w.Revoke([]string{second.ID}, false)
	close(release)
	res := results(t, replies, 2, 10*time.Second)
	if got := res[second.ID]; len(got) != 1 || got[0]["status"] != "REVOKED" {
		t.Errorf("revoked while waiting: %v, want REVOKED", got)
	}
	if got := res[taskID(1)]; len(got) != 1 || got[0]["status"] != "SUCCESS" {
		t.Errorf("first: %v", got)
	}
	if n := fx.snapshot()["second"]; n != 0 {
		t.Errorf("the revoked task ran %d times", n)
	}
	if _, err := e.store.Get(context.Background(), "t.hold_conn", "second"); !errors.Is(err, idempotency.ErrNotFound) {
		t.Errorf("record of the revoked task: %v, want none", err)
	}
	testkit.WaitFor(t, "queue empty", 10*time.Second, func() bool { return e.queueDepth(e.queue) == 0 })
}

// TestRevokeExpiresETA: a revoked id is answered REVOKED without running; a
// running task revoked with terminate stops; an expired message is REVOKED;
// an ETA message runs when due.
func TestRevokeExpiresETA(t *testing.T) {
	e := newEnv(t)
	fx := &effects{}
	r := e.start(sleepRegistry(t, fx), e.config())
	replyTo, replies := e.replyQueue()

	revoked := sleepMessage(1, 0, replyTo)
	r.w.Revoke([]string{revoked.ID}, false)
	e.publish(revoked)
	got := results(t, replies, 1, 10*time.Second)[revoked.ID][0]
	if got["status"] != "REVOKED" || fmt.Sprint(got["result"]) != "map[exc_message:[revoked] exc_module:celery.exceptions exc_type:TaskRevokedError]" {
		t.Errorf("revoked: %v", got)
	}

	long := sleepMessage(2, 30000, replyTo)
	e.publish(long)
	testkit.WaitFor(t, "running", 10*time.Second, func() bool { return len(r.w.Active()) == 1 })
	if a := r.w.Active(); a[0].ID != long.ID || a[0].Name != "t.sleep" {
		t.Errorf("Active = %+v", a)
	}
	r.w.Revoke([]string{long.ID}, true)
	got = results(t, replies, 1, 10*time.Second)[long.ID][0]
	if got["status"] != "REVOKED" {
		t.Errorf("terminated: %v", got)
	}

	expired := sleepMessage(3, 0, replyTo)
	expired.Expires = time.Now().Add(-time.Minute)
	e.publish(expired)
	got = results(t, replies, 1, 10*time.Second)[expired.ID][0]
	if got["status"] != "REVOKED" || fmt.Sprint(got["result"]) != "map[exc_message:[expired] exc_module:celery.exceptions exc_type:TaskRevokedError]" {
		t.Errorf("expired: %v", got)
	}

	eta := sleepMessage(4, 0, replyTo)
	eta.ETA = time.Now().Add(1500 * time.Millisecond)
	sent := time.Now()
	e.publish(eta)
	quick := sleepMessage(5, 0, replyTo)
	e.publish(quick)
	testkit.WaitFor(t, "scheduled", 5*time.Second, func() bool { return len(r.w.Scheduled()) == 1 })
	res := results(t, replies, 2, 10*time.Second)
	if len(res[quick.ID]) != 1 || len(res[eta.ID]) != 1 {
		t.Fatalf("results: %v", res)
	}
	if took := time.Since(sent); took < 1400*time.Millisecond {
		t.Errorf("ETA task answered after %s, before its ETA", took)
	}
	if c := fx.snapshot(); c["s-1"] != 0 || c["s-2"] != 0 || c["s-3"] != 0 || c["s-4"] != 1 || c["s-5"] != 1 {
		t.Errorf("effects %v", c)
	}
	testkit.WaitFor(t, "queue empty", 10*time.Second, func() bool { return e.queueDepth(e.queue) == 0 })
}

// TestCrashPoints: the configured crash point fires once, for the named
// task only, at the right step (the kill is recorded instead of executed).
func TestCrashPoints(t *testing.T) {
	for _, at := range []string{workerhooks.AfterClaim, workerhooks.AfterEffect, workerhooks.BeforeAck} {
		t.Run(at, func(t *testing.T) {
			e := newEnv(t)
			fx := &effects{}
			cfg := e.config()
			cfg.hooks.Crash = workerhooks.Crash{At: at, Task: "t.pay"}
			cfg.Concurrency = 1
			w, err := NewWorker(testRegistry(t, fx), cfg)
			if err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			var seen []string
			w.kill = func() {
				mu.Lock()
				defer mu.Unlock()
				// What had happened when the process would have died.
				seen = append(seen, fmt.Sprintf("effects=%d", len(fx.snapshot())))
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- w.Run(ctx) }()
			defer func() {
				cancel()
				if err := <-done; err != nil {
					t.Error(err)
				}
			}()
			replyTo, replies := e.replyQueue()
			e.publish(&celeryproto.Message{Protocol: 2, Task: "t.add", ID: taskID(1), Args: []any{int64(1), int64(2)}, ReplyTo: replyTo})
			e.publish(payMessage("t.pay", 2, "c-1", replyTo))
			e.publish(payMessage("t.pay", 3, "c-2", replyTo))
			results(t, replies, 3, 20*time.Second)
			mu.Lock()
			defer mu.Unlock()
			want := map[string]string{workerhooks.AfterClaim: "effects=0", workerhooks.AfterEffect: "effects=1", workerhooks.BeforeAck: "effects=1"}[at]
			if len(seen) != 1 || seen[0] != want {
				t.Errorf("kill calls %v, want one with %s", seen, want)
			}
		})
	}
}

// TestNoRecord: without the record every copy runs: 3 copies, 3 effects.
func TestNoRecord(t *testing.T) {
	e := newEnv(t)
	fx := &effects{}
	cfg := e.config()
	cfg.hooks.NoRecord, cfg.Store = true, nil
	e.start(testRegistry(t, fx), cfg)
	replyTo, replies := e.replyQueue()
	for i := range 3 {
		e.publish(payMessage("t.pay", i, "nr-1", replyTo))
	}
	results(t, replies, 3, 20*time.Second)
	if n := fx.snapshot()["nr-1"]; n != 3 {
		t.Errorf("%d effects without the record, want 3", n)
	}
}

type recorder struct {
	mu     sync.Mutex
	events []map[string]any
}

func (r *recorder) Event(_ context.Context, typ string, fields map[string]any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	fields["type"] = typ
	r.events = append(r.events, fields)
}

// TestEventsOfRefusedMessages: as from Celery's worker, an unknown task
// gives task-failed NotRegistered('name') and no task-received, bad
// arguments task-received then task-failed TypeError, and an expired
// message task-revoked alone.
func TestEventsOfRefusedMessages(t *testing.T) {
	e := newEnv(t)
	rec := &recorder{}
	cfg := e.config()
	cfg.Observer = rec
	e.start(testRegistry(t, &effects{}), cfg)
	replyTo, replies := e.replyQueue()
	e.publish(&celeryproto.Message{Protocol: 2, Task: "t.nope", ID: taskID(1), ReplyTo: replyTo, CorrelationID: taskID(1)})
	e.publish(&celeryproto.Message{Protocol: 2, Task: "t.add", ID: taskID(2), Args: []any{"x", 1}, ReplyTo: replyTo, CorrelationID: taskID(2)})
	gone := &celeryproto.Message{Protocol: 2, Task: "t.add", ID: taskID(3), Args: []any{int64(1), int64(2)}, ReplyTo: replyTo, CorrelationID: taskID(3)}
	gone.Expires = time.Now().Add(-time.Minute)
	e.publish(gone)
	results(t, replies, 3, 10*time.Second)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	got := map[string][]string{}
	for _, ev := range rec.events {
		id := fmt.Sprint(ev["uuid"])
		s := fmt.Sprint(ev["type"])
		if ev["type"] == "task-failed" {
			s += " " + fmt.Sprint(ev["exception"])
		}
		got[id] = append(got[id], s)
	}
	for id, want := range map[string][]string{
		taskID(1): {"task-failed NotRegistered('t.nope')"},
		taskID(2): {"task-received", "task-failed TypeError('bad arguments for t.add: argument x: expected int64, got str')"},
		taskID(3): {"task-revoked"},
	} {
		if fmt.Sprint(got[id]) != fmt.Sprint(want) {
			t.Errorf("%s: events %q, want %q", id, got[id], want)
		}
	}
}

// TestObserverEvents: the Observer sees Celery's task events with their
// fields, a duplicate marked onceler_duplicate, and never argument values
// beyond Celery's own reprs or the operation key itself.
func TestObserverEvents(t *testing.T) {
	e := newEnv(t)
	rec := &recorder{}
	cfg := e.config()
	cfg.Observer, cfg.Concurrency = rec, 1
	e.start(testRegistry(t, &effects{}), cfg)
	res := e.python(2, "json",
		pyCall{Task: "t.pay", Kwargs: map[string]any{"order_id": "ev-1", "amount": 3}},
		pyCall{Task: "t.pay", Kwargs: map[string]any{"order_id": "ev-1", "amount": 3}},
		pyCall{Task: "t.fail_value", Args: []any{1, 2}},
	)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	var got []string
	for _, ev := range rec.events {
		s := fmt.Sprintf("%s:%s", ev["type"], ev["uuid"])
		if ev["onceler_duplicate"] == true {
			s += ":dup"
		}
		got = append(got, s)
		if ev["type"] == "task-received" && (ev["kwargs"] == nil || ev["name"] == nil || ev["retries"] == nil) {
			t.Errorf("task-received fields: %v", ev)
		}
		for k, v := range ev {
			if fmt.Sprint(v) == "ev-1" {
				t.Errorf("event %s field %s carries the operation key", ev["type"], k)
			}
		}
	}
	// task-received goes when a message arrives (before a slot is free):
	// each task's own events are in order, and the tasks run in order.
	want := map[string][]string{
		res[0].ID: {"task-received:" + res[0].ID, "task-started:" + res[0].ID, "task-succeeded:" + res[0].ID},
		res[1].ID: {"task-received:" + res[1].ID, "task-succeeded:" + res[1].ID + ":dup"},
		res[2].ID: {"task-received:" + res[2].ID, "task-started:" + res[2].ID, "task-failed:" + res[2].ID},
	}
	byID := map[string][]string{}
	var ends []string
	for _, s := range got {
		id := strings.SplitN(s, ":", 3)[1]
		byID[id] = append(byID[id], s)
		if !strings.HasPrefix(s, "task-received:") && !strings.HasPrefix(s, "task-started:") {
			ends = append(ends, id)
		}
	}
	for id, w := range want {
		if fmt.Sprint(byID[id]) != fmt.Sprint(w) {
			t.Errorf("events of %s\n got %v\nwant %v (all: %v)", id, byID[id], w, got)
		}
	}
	if fmt.Sprint(ends) != fmt.Sprint([]string{res[0].ID, res[1].ID, res[2].ID}) || len(got) != 8 {
		t.Errorf("events %v: tasks not answered in order", got)
	}
}
