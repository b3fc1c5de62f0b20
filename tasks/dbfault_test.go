package tasks

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
	"github.com/onceler/onceler/internal/workerhooks"
)

func TestDBFault(t *testing.T) {
	terminated := &pgconn.PgError{Severity: "FATAL", Code: "57P01", Message: "terminating connection due to administrator command"}
	cases := []struct {
		name       string
		err        error
		connClosed bool
		want       bool
	}{
		{"nil", nil, false, false},
		{"terminated, wrapped by the task", fmt.Errorf("insert sleep: %w", terminated), false, true},
		{"connection exception", &pgconn.PgError{Severity: "ERROR", Code: "08006"}, false, true},
		{"serialization failure", &pgconn.PgError{Severity: "ERROR", Code: "40001"}, false, true},
		{"fatal", &pgconn.PgError{Severity: "FATAL", Code: "XX000"}, false, true},
		{"unique violation", fmt.Errorf("insert: %w", &pgconn.PgError{Severity: "ERROR", Code: "23505"}), false, false},
		{"unknown outcome", fmt.Errorf("x: %w", idempotency.ErrUnknownOutcome), false, true},
		{"net error", fmt.Errorf("q: %w", &net.OpError{Op: "read", Err: errors.New("connection reset")}), false, true},
		{"unexpected EOF", fmt.Errorf("q: %w", io.ErrUnexpectedEOF), false, true},
		{"task error", ValueError("bad"), false, false},
		{"task error on a closed connection", ValueError("bad"), true, true},
		{"soft time limit on a closed connection", fmt.Errorf("%w: %w", ErrSoftTimeLimit, terminated), true, false},
		{"revoked", fmt.Errorf("%w: x", ErrRevoked), true, false},
		{"own deadline", fmt.Errorf("q: %w", context.DeadlineExceeded), true, false},
		{"shutdown", ErrShutdown, false, false},
	}
	for _, c := range cases {
		if got := dbFault(c.err, c.connClosed); got != c.want {
			t.Errorf("%s: dbFault = %v, want %v", c.name, got, c.want)
		}
	}
}

// TestSameDBBackendTerminated: a same-database task whose connection is
// terminated by the server (pg_terminate_backend of its own backend, FATAL
// 57P01, wrapped by the task) is run again, not failed: the caller gets
// SUCCESS and the effect is there once; with the record and without it
// (NoRecord, the task's own transaction). A task's own error still fails.
func TestSameDBBackendTerminated(t *testing.T) {
	for _, noRecord := range []bool{false, true} {
		t.Run(fmt.Sprintf("norecord=%v", noRecord), func(t *testing.T) {
			e := newEnv(t)
			pool := testenvPool(t)
			table := pgx.Identifier{e.schema, "term_ledger"}.Sanitize()
			ctx := context.Background()
			if _, err := pool.Exec(ctx, `CREATE TABLE `+table+` (entry text NOT NULL)`); err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			runs := map[string]int{}
			reg := NewRegistry()
			must := func(err error) {
				if err != nil {
					t.Fatal(err)
				}
			}
			must(Register(reg, Task[payArgs]{Name: "t.credit", Mode: ModeSameDB,
				Key: func(a payArgs) (string, error) { return a.OrderID, nil },
				RunTx: func(ctx context.Context, tx pgx.Tx, c *Call, a payArgs) (any, error) {
					mu.Lock()
					runs[a.OrderID]++
					n := runs[a.OrderID]
					mu.Unlock()
					if _, err := tx.Exec(ctx, `INSERT INTO `+table+` VALUES ($1)`, a.OrderID); err != nil {
						return nil, fmt.Errorf("insert entry: %w", err)
					}
					if n == 1 && strings.HasPrefix(a.OrderID, "term") {
						// Terminates this transaction's own backend.
						if _, err := tx.Exec(ctx, `SELECT pg_terminate_backend(pg_backend_pid())`); err != nil {
							return nil, fmt.Errorf("terminate: %w", err)
						}
						return nil, errors.New("backend survived pg_terminate_backend")
					}
					if strings.HasPrefix(a.OrderID, "bad") {
						return nil, ValueError("refused")
					}
					return map[string]any{"entry": a.OrderID}, nil
				}}))
			cfg := e.config()
			cfg.Concurrency = 2
			if noRecord {
				cfg.hooks.NoRecord, cfg.Store, cfg.Pool = true, nil, pool
			}
			e.start(reg, cfg)
			replyTo, replies := e.replyQueue()
			e.publish(payMessage("t.credit", 0, "term-1", replyTo))
			e.publish(payMessage("t.credit", 1, "term-2", replyTo))
			e.publish(payMessage("t.credit", 2, "bad-1", replyTo))
			res := results(t, replies, 3, 30*time.Second)
			for i, key := range []string{"term-1", "term-2"} {
				if r := res[taskID(i)]; len(r) != 1 || r[0]["status"] != "SUCCESS" {
					t.Errorf("%s: results %v, want one SUCCESS", key, r)
				}
				var n int
				if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+table+` WHERE entry = $1`, key).Scan(&n); err != nil || n != 1 {
					t.Errorf("%s: %d rows (err %v), want 1", key, n, err)
				}
				mu.Lock()
				if runs[key] != 2 {
					t.Errorf("%s ran %d times, want 2 (terminated, then again)", key, runs[key])
				}
				mu.Unlock()
			}
			if r := res[taskID(2)]; len(r) != 1 || r[0]["status"] != "FAILURE" {
				t.Errorf("bad-1: results %v, want one FAILURE", r)
			}
			mu.Lock()
			if runs["bad-1"] != 1 {
				t.Errorf("bad-1 ran %d times, want 1", runs["bad-1"])
			}
			mu.Unlock()
			testkit.WaitFor(t, "queue empty", 10*time.Second, func() bool { return e.queueDepth(e.queue) == 0 })
		})
	}
}

// redeliver puts messages in the queue and makes the broker redeliver
// them: taken without ack on a channel of its own, which is then closed.
func (e *env) redeliver(ms ...*celeryprotoMessage) {
	e.t.Helper()
	for _, m := range ms {
		e.publish(m)
	}
	ch, err := e.conn.Channel()
	if err != nil {
		e.t.Fatal(err)
	}
	for range ms {
		var ok bool
		for start := time.Now(); !ok && time.Since(start) < 10*time.Second; {
			if _, ok, err = ch.Get(e.queue, false); err != nil {
				e.t.Fatal(err)
			}
		}
		if !ok {
			e.t.Fatal("published message not in the queue")
		}
	}
	if err := ch.Close(); err != nil {
		e.t.Fatal(err)
	}
}

// TestSameDBPoisonRedelivered: on a classic queue a redelivered
// same-database message counts an attempt at its operation (committed on
// its own, CountAttempt); past MaxAttempts it is quarantined as poison
// without running. Below the limit it runs; a first delivery counts
// nothing; a completed operation's redelivery is answered from the record.
func TestSameDBPoisonRedelivered(t *testing.T) {
	e := newEnv(t)
	pool := testenvPool(t)
	table := pgx.Identifier{e.schema, "poison_ledger"}.Sanitize()
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE TABLE `+table+` (entry text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	reg := NewRegistry()
	if err := Register(reg, Task[payArgs]{Name: "t.credit", Mode: ModeSameDB,
		Key: func(a payArgs) (string, error) { return a.OrderID, nil },
		RunTx: func(ctx context.Context, tx pgx.Tx, c *Call, a payArgs) (any, error) {
			if _, err := tx.Exec(ctx, `INSERT INTO `+table+` VALUES ($1)`, a.OrderID); err != nil {
				return nil, err
			}
			return map[string]any{"entry": a.OrderID}, nil
		}}); err != nil {
		t.Fatal(err)
	}
	const limit = 2
	// "poison" was redelivered limit times before: this is one more.
	for range limit {
		if _, err := e.store.CountAttempt(ctx, "t.credit", "poison"); err != nil {
			t.Fatal(err)
		}
	}
	// "done" completed before: its redelivery past the limit is a duplicate.
	if _, err := e.store.RunTx(ctx, idempotency.ClaimParams{Task: "t.credit", Key: "done", Owner: "x", TaskID: "x"},
		func(context.Context, pgx.Tx) ([]byte, error) { return []byte(`{"entry":"done"}`), nil }); err != nil {
		t.Fatal(err)
	}
	for range limit {
		if _, err := e.store.CountAttempt(ctx, "t.credit", "done"); err != nil {
			t.Fatal(err)
		}
	}
	replyTo, replies := e.replyQueue()
	e.redeliver(payMessage("t.credit", 0, "poison", replyTo), payMessage("t.credit", 1, "again", replyTo),
		payMessage("t.credit", 3, "done", replyTo))
	cfg := e.config()
	cfg.MaxAttempts = limit
	e.start(reg, cfg)
	e.publish(payMessage("t.credit", 2, "fresh", replyTo))
	res := results(t, replies, 4, 30*time.Second)
	for _, i := range []int{1, 2, 3} {
		if r := res[taskID(i)]; len(r) != 1 || r[0]["status"] != "SUCCESS" {
			t.Errorf("task %d: results %v, want one SUCCESS", i, r)
		}
	}
	var q []string
	testkit.WaitFor(t, "the poison message in quarantine", 10*time.Second, func() bool {
		for _, d := range e.quarantined() {
			q = append(q, fmt.Sprint(d.Headers[HeaderReason], " ", d.Headers["id"]))
		}
		return len(q) > 0
	})
	if len(q) != 1 || q[0] != ReasonPoison+" "+taskID(0) {
		t.Errorf("quarantined %v, want the poison message", q)
	}
	// Its caller hears that the task's worker kept dying, as from Celery.
	if r := res[taskID(0)]; len(r) != 1 || r[0]["status"] != "FAILURE" || fmt.Sprint(r[0]["result"].(map[string]any)["exc_type"]) != "WorkerLostError" {
		t.Errorf("poison message answered %v, want one FAILURE WorkerLostError", r)
	}
	count := func(key string) int {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+table+` WHERE entry = $1`, key).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	for key, want := range map[string]int{"poison": 0, "again": 1, "fresh": 1, "done": 0} {
		if n := count(key); n != want {
			t.Errorf("%s: %d rows, want %d", key, n, want)
		}
	}
	// Attempts counted: one for each redelivery, none for the first delivery.
	for key, want := range map[string]int{"poison": limit + 2, "again": 2, "fresh": 1, "done": limit + 2} {
		if n, err := e.store.CountAttempt(ctx, "t.credit", key); err != nil || n != want {
			t.Errorf("%s: next attempt count %d (err %v), want %d", key, n, err, want)
		}
	}
	testkit.WaitFor(t, "queue empty", 10*time.Second, func() bool { return e.queueDepth(e.queue) == 0 })
}

// TestFailedPolicyStepDecidesAgain: the lookup policy takes a stale claim
// over with the delivery's token, the lookup finds the operation done, and
// the completion that records it fails (its statement never reaches the
// server). The delivery must not then claim again with that token, which
// would be its own and run the task: with a new token it finds the
// takeover in progress, then stale, and the policy decides again.
func TestFailedPolicyStepDecidesAgain(t *testing.T) {
	e := newEnv(t)
	pool, proxy := testenv.ProxiedPool(t)
	store := e.storeOn(pool, idempotency.BatchConfig{})
	fx := &effects{}
	var lookups atomic.Int32
	reg := NewRegistry()
	if err := Register(reg, Task[payArgs]{Name: "p.lookup", Mode: ModeOutside, Policy: PolicyLookup, Fallback: PolicyHold,
		Key: func(a payArgs) (string, error) { return a.OrderID, nil },
		Run: func(_ context.Context, c *Call, a payArgs) (any, error) {
			fx.add(c.Reference)
			return map[string]any{"ran": a.OrderID}, nil
		},
		Lookup: func(_ context.Context, _ *Call, a payArgs) (any, bool, error) {
			lookups.Add(1)
			return map[string]any{"found": "gateway-says-done"}, true, nil
		}}); err != nil {
		t.Fatal(err)
	}
	cfg := e.config()
	cfg.Store, cfg.Pool = store, pool
	cfg.Lease = time.Second
	e.start(reg, cfg)
	replyTo, replies := e.replyQueue()
	order := "lookup-then-cut"
	kwargs := map[string]any{"order_id": order, "amount": int64(100)}
	e.staleClaim("p.lookup", order, kwargs)
	proxy.ArmDrop("gateway-says-done") // the completion after the lookup
	m := payMessage("p.lookup", 1, order, replyTo)
	e.publish(m)
	r := results(t, replies, 1, 30*time.Second)[m.ID][0]
	if body, _ := jsonString(r["result"]); r["status"] != "SUCCESS" || !strings.Contains(body, "gateway-says-done") {
		t.Errorf("reply %v, want SUCCESS with the looked-up result", r)
	}
	if n := len(fx.snapshot()); n != 0 {
		t.Errorf("the task ran %d times although the lookup found the operation done", n)
	}
	if n := lookups.Load(); n != 2 {
		t.Errorf("%d lookups, want 2 (the completion of the first failed)", n)
	}
	rec, err := e.store.Get(context.Background(), "p.lookup", order)
	if err != nil || rec.Status != idempotency.StatusCompleted {
		t.Errorf("record %+v %v, want completed", rec.Status, err)
	}
	testkit.WaitFor(t, "queue empty", 10*time.Second, func() bool { return e.queueDepth(e.queue) == 0 })
}

// TestLostClaimAnswer: the record's connection is cut just after a claim
// reached the server, so the claim commits and the worker never hears of
// it. The worker claims again with the same token and finds the claim its
// own: the task runs once and completes, under attempt 1. Before, it found
// its own claim in progress, waited for the lease to lapse and applied the
// stale-claim policy to itself (hold: held, skip: skipped, nothing run).
func TestLostClaimAnswer(t *testing.T) {
	e := newEnv(t)
	pool, proxy := testenv.ProxiedPool(t)
	store := e.storeOn(pool, idempotency.BatchConfig{})
	fx := &effects{}
	reg := NewRegistry()
	for _, tk := range []Task[payArgs]{{Name: "p.hold", Policy: PolicyHold}, {Name: "p.skip", Policy: PolicySkip}} {
		tk.Mode = ModeOutside
		tk.Key = func(a payArgs) (string, error) { return a.OrderID, nil }
		tk.Run = func(_ context.Context, c *Call, a payArgs) (any, error) {
			fx.add(c.Reference)
			return map[string]any{"ran": a.OrderID, "attempt": c.Attempt}, nil
		}
		if err := Register(reg, tk); err != nil {
			t.Fatal(err)
		}
	}
	cfg := e.config()
	cfg.Store, cfg.Pool = store, pool
	cfg.Lease = time.Second
	e.start(reg, cfg)
	replyTo, replies := e.replyQueue()
	for i, task := range []string{"p.hold", "p.skip"} {
		order := "lost-claim-" + task
		proxy.Arm(order)
		m := payMessage(task, 200+i, order, replyTo)
		e.publish(m)
		r := results(t, replies, 1, 30*time.Second)[m.ID][0]
		if proxy.Lost() != i+1 {
			t.Fatalf("%s: %d claims committed with their answers lost, want %d", task, proxy.Lost(), i+1)
		}
		if body, _ := jsonString(r["result"]); r["status"] != "SUCCESS" || !strings.Contains(body, `"attempt":1`) {
			t.Errorf("%s: reply %v, want SUCCESS under attempt 1", task, r)
		}
		if n := fx.snapshot()[task+":"+order]; n != 1 {
			t.Errorf("%s: %d effects, want 1", task, n)
		}
		rec, err := e.store.Get(context.Background(), task, order)
		if err != nil || rec.Status != idempotency.StatusCompleted || rec.Attempt != 1 {
			t.Errorf("%s: record %+v %v, want completed under attempt 1", task, rec, err)
		}
	}
	testkit.WaitFor(t, "queue empty", 10*time.Second, func() bool { return e.queueDepth(e.queue) == 0 })
}

// startCrashing runs a worker of reg, with one slot, whose crash point at
// fires for task; the kill is recorded instead of executed, as what state
// says then. kills returns the records.
func (e *env) startCrashing(reg *Registry, at, task string, state func() string) (kills func() []string) {
	e.t.Helper()
	cfg := e.config()
	cfg.hooks.Crash = workerhooks.Crash{At: at, Task: task}
	cfg.Concurrency = 1
	w, err := NewWorker(reg, cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	var mu sync.Mutex
	var seen []string
	w.kill = func() {
		mu.Lock()
		defer mu.Unlock()
		seen = append(seen, state())
	}
	e.run(w)
	return func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), seen...)
	}
}

// TestCrashPointsPure: a pure task reaches after_claim before it runs and
// after_effect after it returned (the kill is recorded instead of executed).
func TestCrashPointsPure(t *testing.T) {
	for _, at := range []string{workerhooks.AfterClaim, workerhooks.AfterEffect, workerhooks.BeforeAck} {
		t.Run(at, func(t *testing.T) {
			e := newEnv(t)
			var ran atomic.Int32
			reg := NewRegistry()
			if err := Register(reg, Task[addArgs]{Name: "t.add", Run: func(_ context.Context, _ *Call, a addArgs) (any, error) {
				ran.Add(1)
				return a.X + a.Y, nil
			}}); err != nil {
				t.Fatal(err)
			}
			kills := e.startCrashing(reg, at, "t.add", func() string { return fmt.Sprintf("ran=%d", ran.Load()) })
			replyTo, replies := e.replyQueue()
			for i := range 2 {
				e.publish(&celeryproto.Message{Protocol: 2, Task: "t.add", ID: taskID(i), Args: []any{int64(1), int64(2)}, ReplyTo: replyTo})
			}
			results(t, replies, 2, 20*time.Second)
			seen := kills()
			want := map[string]string{workerhooks.AfterClaim: "ran=0", workerhooks.AfterEffect: "ran=1", workerhooks.BeforeAck: "ran=1"}[at]
			if len(seen) != 1 || seen[0] != want {
				t.Errorf("kill calls %v, want one with %s", seen, want)
			}
		})
	}
}

// TestCrashPoints: the configured crash point fires once, for the named
// task only, at the right step (the kill is recorded instead of executed).
func TestCrashPoints(t *testing.T) {
	for _, at := range []string{workerhooks.AfterClaim, workerhooks.AfterEffect, workerhooks.BeforeAck} {
		t.Run(at, func(t *testing.T) {
			e := newEnv(t)
			fx := &effects{}
			// What had happened when the process would have died.
			kills := e.startCrashing(testRegistry(t, fx), at, "t.pay", func() string { return fmt.Sprintf("effects=%d", len(fx.snapshot())) })
			replyTo, replies := e.replyQueue()
			e.publish(&celeryproto.Message{Protocol: 2, Task: "t.add", ID: taskID(1), Args: []any{int64(1), int64(2)}, ReplyTo: replyTo})
			e.publish(payMessage("t.pay", 2, "c-1", replyTo))
			e.publish(payMessage("t.pay", 3, "c-2", replyTo))
			results(t, replies, 3, 20*time.Second)
			seen := kills()
			want := map[string]string{workerhooks.AfterClaim: "effects=0", workerhooks.AfterEffect: "effects=1", workerhooks.BeforeAck: "effects=1"}[at]
			if len(seen) != 1 || seen[0] != want {
				t.Errorf("kill calls %v, want one with %s", seen, want)
			}
		})
	}
}

// TestCompletionOfAForgottenClaim: an outside task whose claim is gone from
// the record when it completes (as after a failover to a standby the claim
// never reached, with asynchronous replication) is not retried for ever: the
// completion finds no claim, the delivery is looked at again, claimed anew
// and run again (its outside effect repeated: the cost of the lost claim),
// and its caller answered once.
func TestCompletionOfAForgottenClaim(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	pool := testenvPool(t)
	records := pgx.Identifier{e.schema, "records"}.Sanitize()
	var runs atomic.Int32
	reg := NewRegistry()
	if err := Register(reg, Task[payArgs]{Name: "t.forget", Mode: ModeOutside, Policy: PolicyLookup, Fallback: PolicyHold,
		Key: func(a payArgs) (string, error) { return a.OrderID, nil },
		Lookup: func(context.Context, *Call, payArgs) (any, bool, error) {
			return nil, false, errors.New("lookup not expected")
		},
		Run: func(ctx context.Context, c *Call, a payArgs) (any, error) {
			if runs.Add(1) == 1 {
				if _, err := pool.Exec(ctx, `DELETE FROM `+records+` WHERE task = $1 AND key = $2`, "t.forget", c.Key); err != nil {
					return nil, fmt.Errorf("forget the claim: %w", err)
				}
			}
			return map[string]any{"order": a.OrderID}, nil
		}}); err != nil {
		t.Fatal(err)
	}
	e.start(reg, e.config())
	replyTo, replies := e.replyQueue()
	e.publish(payMessage("t.forget", 0, "forgotten-1", replyTo))
	res := results(t, replies, 1, 30*time.Second)
	if r := res[taskID(0)]; len(r) != 1 || r[0]["status"] != "SUCCESS" {
		t.Errorf("results %v, want one SUCCESS", r)
	}
	if n := runs.Load(); n != 2 {
		t.Errorf("ran %d times, want 2 (the claim forgotten, then claimed and run again)", n)
	}
	rec, err := e.store.Get(context.Background(), "t.forget", "forgotten-1")
	if err != nil || rec.Status != idempotency.StatusCompleted {
		t.Errorf("record %v (%v), want completed", rec.Status, err)
	}
	testkit.WaitFor(t, "queue empty", 10*time.Second, func() bool { return e.queueDepth(e.queue) == 0 })
}
