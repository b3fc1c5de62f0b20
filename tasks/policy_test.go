package tasks

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testkit"
)

// staleClaim leaves a claim of (task, key) by a dead owner whose lease has
// lapsed, with the fingerprint the worker will compute for the message.
func (e *env) staleClaim(task, key string, kwargs map[string]any) {
	e.t.Helper()
	fp, err := celeryproto.Fingerprint(nil, kwargs)
	if err != nil {
		e.t.Fatal(err)
	}
	c, err := e.store.Claim(context.Background(), idempotency.ClaimParams{Task: task, Key: key, Fingerprint: fp,
		Owner: "dead@node", TaskID: "dead-task", Lease: 50 * time.Millisecond})
	if err != nil || c.Outcome != idempotency.OutcomeFirst {
		e.t.Fatalf("claim: %v %v", c.Outcome, err)
	}
	time.Sleep(100 * time.Millisecond)
}

// TestStalePolicies: an operation whose owner died after claiming is settled
// by each task's policy when its message comes again.
func TestStalePolicies(t *testing.T) {
	e := newEnv(t)
	fx := &effects{}
	var lookups atomic.Int32
	reg := NewRegistry()
	key := func(a payArgs) (string, error) { return a.OrderID, nil }
	run := func(_ context.Context, c *Call, a payArgs) (any, error) {
		fx.add(c.Reference)
		return map[string]any{"ran": a.OrderID, "attempt": c.Attempt}, nil
	}
	lookup := func(_ context.Context, c *Call, a payArgs) (any, bool, error) {
		lookups.Add(1)
		switch {
		case strings.HasPrefix(a.OrderID, "found"):
			return map[string]any{"found": a.OrderID}, true, nil
		case strings.HasPrefix(a.OrderID, "broken"):
			return nil, false, errors.New("outside system down")
		}
		return nil, false, nil
	}
	for _, tk := range []Task[payArgs]{
		{Name: "p.retry", Policy: PolicyRetry},
		{Name: "p.skip", Policy: PolicySkip},
		{Name: "p.hold", Policy: PolicyHold},
		{Name: "p.lookup", Policy: PolicyLookup, Lookup: lookup, Fallback: PolicySkip},
	} {
		tk.Mode, tk.Key, tk.Run = ModeOutside, key, run
		if err := Register(reg, tk); err != nil {
			t.Fatal(err)
		}
	}
	w := e.start(reg, e.config())
	replyTo, replies := e.replyQueue()

	cases := []struct {
		task, order string
		status      string // reply status, "" for none
		result      string // substring of the reply
		effects     int
		record      idempotency.Status
	}{
		{"p.retry", "r-1", "SUCCESS", `"attempt":2`, 1, idempotency.StatusCompleted},
		{"p.skip", "s-1", "FAILURE", "OperationSkipped", 0, idempotency.StatusSkipped},
		{"p.hold", "h-1", "FAILURE", "OperationHeld", 0, idempotency.StatusHeld},
		{"p.lookup", "found-1", "SUCCESS", `"found":"found-1"`, 0, idempotency.StatusCompleted},
		{"p.lookup", "missing-1", "SUCCESS", `"ran":"missing-1"`, 1, idempotency.StatusCompleted},
		{"p.lookup", "broken-1", "FAILURE", "OperationSkipped", 0, idempotency.StatusSkipped},
	}
	for i, tc := range cases {
		t.Run(tc.task+"/"+tc.order, func(t *testing.T) {
			kwargs := map[string]any{"order_id": tc.order, "amount": int64(100)}
			e.staleClaim(tc.task, tc.order, kwargs)
			m := payMessage(tc.task, 100+i, tc.order, replyTo)
			e.publish(m)
			if tc.status == "" {
				select {
				case r := <-replies:
					t.Fatalf("unexpected reply %v", r)
				case <-time.After(time.Second):
				}
			} else {
				r := results(t, replies, 1, 20*time.Second)[m.ID][0]
				body := fmt.Sprint(r)
				if enc, err := jsonString(r["result"]); err == nil {
					body = enc
				}
				if r["status"] != tc.status || !strings.Contains(body, tc.result) {
					t.Fatalf("reply %v, want %s with %s", r, tc.status, tc.result)
				}
			}
			if n := fx.snapshot()[tc.task+":"+tc.order]; n != tc.effects {
				t.Errorf("%d effects, want %d", n, tc.effects)
			}
			rec, err := e.store.Get(context.Background(), tc.task, tc.order)
			if err != nil {
				t.Fatal(err)
			}
			if rec.Status != tc.record {
				t.Errorf("record status %s, want %s", rec.Status, tc.record)
			}
			if tc.record == idempotency.StatusHeld {
				// The test publishes to the default exchange, keyed by queue name.
				ex, rk, p, err := DecodeHeld(rec.Message)
				if err != nil {
					t.Fatalf("held message: %v", err)
				}
				if ex != "" || rk != e.queue || p.Headers["id"] != m.ID || len(p.Body) == 0 {
					t.Errorf("held message: exchange %q key %q headers %v", ex, rk, p.Headers)
				}
			}
			testkit.WaitFor(t, "queue empty", 10*time.Second, func() bool { return e.queueDepth(e.queue) == 0 })
		})
	}
	if lookups.Load() != 3 {
		t.Errorf("lookup called %d times, want 3", lookups.Load())
	}
	for _, c := range []struct {
		task, policy string
		n            float64
	}{{"p.retry", "retry", 1}, {"p.skip", "skip", 1}, {"p.hold", "hold", 1}, {"p.lookup", "lookup", 3}} {
		if got := counter(w.w.m.stale.WithLabelValues(c.task, c.policy)); got != c.n {
			t.Errorf("onceler_stale_claims_total{task=%q,policy=%q} = %v, want %v", c.task, c.policy, got, c.n)
		}
	}
	if got := counter(w.w.m.held.WithLabelValues("p.hold")); got != 1 {
		t.Errorf("onceler_held_total{task=\"p.hold\"} = %v, want 1", got)
	}
}

// TestSameDatabase: the effect, the claim and the completion commit in one
// transaction; 4 copies of each of 50 operations over two workers write 50
// rows; a failing task leaves no row and no record.
func TestSameDatabase(t *testing.T) {
	e := newEnv(t)
	pool := testenvPool(t)
	table := pgx.Identifier{e.schema, "ledger"}.Sanitize()
	if _, err := pool.Exec(context.Background(), "CREATE TABLE "+table+" (entry text, amount bigint)"); err != nil {
		t.Fatal(err)
	}
	reg := NewRegistry()
	err := Register(reg, Task[payArgs]{
		Name: "t.credit", Mode: ModeSameDB,
		Key: func(a payArgs) (string, error) { return a.OrderID, nil },
		RunTx: func(ctx context.Context, tx pgx.Tx, c *Call, a payArgs) (any, error) {
			if _, err := tx.Exec(ctx, "INSERT INTO "+table+" VALUES ($1, $2)", a.OrderID, a.Amount); err != nil {
				return nil, err
			}
			if a.Amount < 0 {
				return nil, ValueError("negative amount")
			}
			return a.Amount, nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	cfg := e.config()
	cfg.Pool = pool
	e.start(reg, cfg)
	cfg2 := e.config()
	cfg2.Pool = pool
	e.start(reg, cfg2)
	replyTo, replies := e.replyQueue()
	const keys = 50
	for i := range keys * 4 {
		m := payMessage("t.credit", i, fmt.Sprintf("e-%d", i/4), replyTo)
		e.publish(m)
	}
	bad := payMessage("t.credit", 9999, "e-bad", replyTo)
	bad.Kwargs["amount"] = int64(-5)
	e.publish(bad)
	res := results(t, replies, keys*4+1, 60*time.Second)
	for i := range keys * 4 {
		if r := res[taskID(i)]; len(r) == 0 || r[0]["status"] != "SUCCESS" {
			t.Errorf("task %d: %v", i, r)
		}
	}
	if r := res[bad.ID]; len(r) == 0 || r[0]["status"] != "FAILURE" {
		t.Errorf("failing task: %v", r)
	}
	var rows, distinct, badRows int
	if err := pool.QueryRow(context.Background(), "SELECT count(*), count(DISTINCT entry), count(*) FILTER (WHERE entry = 'e-bad') FROM "+table).
		Scan(&rows, &distinct, &badRows); err != nil {
		t.Fatal(err)
	}
	if rows != keys || distinct != keys || badRows != 0 {
		t.Errorf("ledger has %d rows (%d distinct, %d of the failed task), want %d", rows, distinct, badRows, keys)
	}
	if _, err := e.store.Get(context.Background(), "t.credit", "e-bad"); !errors.Is(err, idempotency.ErrNotFound) {
		t.Errorf("failed same-database task left a record: %v", err)
	}
	testkit.WaitFor(t, "queue empty", 10*time.Second, func() bool { return e.queueDepth(e.queue) == 0 })
}
