package tasks

import (
	"context"
	"encoding/json"
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
	t.Parallel()
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
		if got := counterValue(w.w.m.stale.WithLabelValues(c.task, c.policy)); got != c.n {
			t.Errorf("onceler_stale_claims_total{task=%q,policy=%q} = %v, want %v", c.task, c.policy, got, c.n)
		}
	}
	if got := counterValue(w.w.m.held.WithLabelValues("p.hold")); got != 1 {
		t.Errorf("onceler_held_total{task=\"p.hold\"} = %v, want 1", got)
	}
}

// TestSameDatabase: the effect, the claim and the completion commit in one
// transaction; 4 copies of each of 50 operations over two workers write 50
// rows; a failing task leaves no row and no record.
func TestSameDatabase(t *testing.T) {
	t.Parallel()
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

// TestLookupAsLongAsTheLeaseAnswered: a lookup policy with fallback retry,
// a LookupTimeout as long as the lease (cut to half of it) and an outside
// system that does not answer: the lookup runs out, the fallback runs the
// task under a lease the database still holds, and the caller is answered.
func TestLookupAsLongAsTheLeaseAnswered(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	const lease = 600 * time.Millisecond
	var lookups, runs atomic.Int32
	r := NewRegistry()
	if err := Register(r, Task[opArgs]{Name: "rv.lookup", Mode: ModeOutside, Policy: PolicyLookup, Fallback: PolicyRetry,
		Key: opKey, Lease: lease, LookupTimeout: lease,
		Lookup: func(ctx context.Context, _ *Call, _ opArgs) (any, bool, error) {
			lookups.Add(1)
			<-ctx.Done() // the outside system does not answer
			return nil, false, context.Cause(ctx)
		},
		Run: func(context.Context, *Call, opArgs) (any, error) { runs.Add(1); return "charged", nil }}); err != nil {
		t.Fatal(err)
	}
	p := idempotency.ClaimParams{Task: "rv.lookup", Key: "op-1", Owner: "dead", TaskID: "dead", Lease: 50 * time.Millisecond}
	if _, err := e.store.Claim(ctx, p); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	e.start(r, e.config())
	replyTo, replies := e.replyQueue()
	e.publish(&celeryproto.Message{Protocol: 2, Task: "rv.lookup", ID: taskID(1), Kwargs: map[string]any{"op": "op-1"},
		ReplyTo: replyTo, CorrelationID: taskID(1)})
	res := collect(replies, 1, 10*time.Second)
	rec, _ := e.store.Get(ctx, "rv.lookup", "op-1")
	if rs := res[taskID(1)]; len(rs) != 1 {
		t.Errorf("not answered within 10 s: %d lookups, %d runs, record %s attempt %d", lookups.Load(), runs.Load(), rec.Status, rec.Attempt)
	}
}

// TestLookupResultUnstorableSettled: a lookup that finds the operation
// done, with a result the database refuses (a number beyond PostgreSQL's
// numeric range): the operation is held for a person (the reason says what
// the lookup found), the caller told OperationHeld, and no claim is left
// behind.
func TestLookupResultUnstorableSettled(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	var runs atomic.Int32
	r := NewRegistry()
	if err := Register(r, Task[opArgs]{Name: "rv.found", Mode: ModeOutside, Policy: PolicyLookup, Fallback: PolicyHold,
		Key: opKey, Lease: time.Second,
		Lookup: func(context.Context, *Call, opArgs) (any, bool, error) {
			return json.RawMessage(`1e999999`), true, nil
		},
		Run: func(context.Context, *Call, opArgs) (any, error) { runs.Add(1); return "charged", nil }}); err != nil {
		t.Fatal(err)
	}
	p := idempotency.ClaimParams{Task: "rv.found", Key: "op-1", Owner: "dead", TaskID: "dead", Lease: 50 * time.Millisecond}
	if _, err := e.store.Claim(ctx, p); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	e.start(r, e.config())
	replyTo, replies := e.replyQueue()
	e.publish(&celeryproto.Message{Protocol: 2, Task: "rv.found", ID: taskID(1), Kwargs: map[string]any{"op": "op-1"},
		ReplyTo: replyTo, CorrelationID: taskID(1)})
	res := collect(replies, 1, 10*time.Second)
	testkit.WaitFor(t, "queue empty", 10*time.Second, func() bool { return e.queueDepth(e.queue) == 0 })
	rec, err := e.store.Get(ctx, "rv.found", "op-1")
	t.Logf("answer %v; runs %d; record %v (%v)", res[taskID(1)], runs.Load(), rec.Status, err)
	if err != nil || rec.Status != idempotency.StatusHeld {
		t.Errorf("record %v (%v), want held", rec.Status, err)
	}
	if rs := res[taskID(1)]; len(rs) != 1 || rs[0]["status"] != "FAILURE" || runs.Load() != 0 {
		t.Errorf("answered %v after %d runs, want one FAILURE and none", rs, runs.Load())
	}
}

// TestSlowLookupRunsOnce: a stale claim, a lookup policy whose lookup is
// slower than the lease (it reads the outside system, then takes its
// time), and two deliveries of the operation at once: the effect happens
// once. The lookup is cut at its time limit (half the lease) and falls back
// to retry under a lease the database still holds; the second delivery
// finds the operation in progress, then completed. Without the limit, the
// first delivery's lease lapsed during its lookup, the second took the
// operation over, and both ran the effect.
func TestSlowLookupRunsOnce(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	const lease = time.Second
	var effects, lookups atomic.Int32
	r := NewRegistry()
	if err := Register(r, Task[opArgs]{Name: "l.charge", Mode: ModeOutside, Policy: PolicyLookup, Fallback: PolicyRetry,
		Key: opKey, Lease: lease,
		Lookup: func(ctx context.Context, _ *Call, _ opArgs) (any, bool, error) {
			lookups.Add(1)
			found := effects.Load() > 0 // what the outside system says now
			select {                    // then the answer takes its time
			case <-time.After(3 * lease / 2):
			case <-ctx.Done():
				return nil, false, context.Cause(ctx)
			}
			return "found", found, nil
		},
		Run: func(context.Context, *Call, opArgs) (any, error) {
			effects.Add(1)
			return "charged", nil
		}}); err != nil {
		t.Fatal(err)
	}
	// A claim whose worker died: stale by the time the messages arrive.
	p := idempotency.ClaimParams{Task: "l.charge", Key: "op-1", Owner: "dead", TaskID: "dead", Lease: 100 * time.Millisecond}
	if _, err := e.store.Claim(ctx, p); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	cfg := e.config()
	cfg.Concurrency = 4
	e.start(r, cfg)
	replyTo, replies := e.replyQueue()
	for i := range 2 {
		e.publish(&celeryproto.Message{Protocol: 2, Task: "l.charge", ID: taskID(i), Kwargs: map[string]any{"op": "op-1"},
			ReplyTo: replyTo, CorrelationID: taskID(i)})
	}
	res := results(t, replies, 2, 20*time.Second)
	for i := range 2 {
		if rs := res[taskID(i)]; len(rs) != 1 || rs[0]["status"] != "SUCCESS" || rs[0]["result"] != "charged" {
			t.Errorf("delivery %d answered %v", i, rs)
		}
	}
	if n := effects.Load(); n != 1 {
		t.Errorf("effect ran %d times (lookups %d), want once", n, lookups.Load())
	}
}
