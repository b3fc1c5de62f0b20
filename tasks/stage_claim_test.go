package tasks

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/idempotency"
)

// TestSlowClaimNotDropped: a first claim that waits on the record's row
// lock longer than the lease (a person resolving, a purge batch, a slow
// database) arrives with its lease lapsed. The renewal before the run finds
// it lapsed and the delivery looks again later with the same token: it
// finds the claim its own and runs the task, once. It is never handed to
// the skip or hold policy, which would settle an operation nobody ran.
func TestSlowClaimNotDropped(t *testing.T) {
	for _, pol := range []Policy{PolicySkip, PolicyHold} {
		t.Run(pol.String(), func(t *testing.T) { slowClaim(t, pol) })
	}
}

func slowClaim(t *testing.T, pol Policy) {
	e := newEnv(t)
	pool := testenvPool(t)
	ctx := context.Background()
	const lease = 500 * time.Millisecond
	var runs atomic.Int32
	r := NewRegistry()
	if err := Register(r, Task[opArgs]{Name: "rv.slowclaim", Mode: ModeOutside, Policy: pol, Key: opKey, Lease: lease,
		Run: func(context.Context, *Call, opArgs) (any, error) { runs.Add(1); return "ran", nil }}); err != nil {
		t.Fatal(err)
	}
	// An earlier attempt failed: the record is claimable again.
	p := idempotency.ClaimParams{Task: "rv.slowclaim", Key: "op-1", Owner: "earlier", TaskID: "earlier", Lease: lease}
	c, err := e.store.Claim(ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.store.Fail(ctx, p.Ref(c.Token), "an earlier failure"); err != nil {
		t.Fatal(err)
	}
	e.start(r, e.config())
	replyTo, replies := e.replyQueue()
	// Someone holds the record's row for three leases.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SELECT 1 FROM `+e.schema+`.records WHERE task = 'rv.slowclaim' AND key = 'op-1' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	e.publish(&celeryproto.Message{Protocol: 2, Task: "rv.slowclaim", ID: taskID(1), Kwargs: map[string]any{"op": "op-1"},
		ReplyTo: replyTo, CorrelationID: taskID(1)})
	time.Sleep(3 * lease)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	res := collect(replies, 1, 10*time.Second)
	rec, gerr := e.store.Get(ctx, "rv.slowclaim", "op-1")
	t.Logf("answer %v; runs %d; record %v (%v)", res[taskID(1)], runs.Load(), rec.Status, gerr)
	if rs := res[taskID(1)]; len(rs) != 1 || rs[0]["status"] != "SUCCESS" || runs.Load() != 1 {
		t.Errorf("an operation that never ran was settled by its stale-claim policy (%s): answered %v, ran %d times, record %v",
			pol, rs, runs.Load(), rec.Status)
	}
}

// TestRecheckAsksTheDatabase: a delivery deferred behind a claim in
// progress looks again by the database's clock, not the worker's: with the
// lease still running in the database, it is not taken over however late
// the worker's clock says it is (Record.Live); once it lapses, it is.
func TestRecheckAsksTheDatabase(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	p := idempotency.ClaimParams{Task: "r.t", Key: "k", Owner: "o", TaskID: "x", Lease: 2 * time.Second}
	if _, err := e.store.Claim(ctx, p); err != nil {
		t.Fatal(err)
	}
	rec, err := e.store.Get(ctx, "r.t", "k")
	if err != nil || !rec.Live {
		t.Fatalf("fresh claim: live %v (%v)", rec.Live, err)
	}
	// Move the stored lease end to the worker's past by a clock skew's
	// worth while the database still counts it as running: only the
	// database's comparison stays right (here: the row says 1 s ahead).
	if _, err := testenvPool(t).Exec(ctx, `UPDATE `+e.schema+`.records SET lease_until = now() + interval '1 second'`); err != nil {
		t.Fatal(err)
	}
	if rec, _ = e.store.Get(ctx, "r.t", "k"); !rec.Live {
		t.Error("running lease read as lapsed")
	}
	time.Sleep(1100 * time.Millisecond)
	if rec, _ = e.store.Get(ctx, "r.t", "k"); rec.Live {
		t.Error("lapsed lease read as live")
	}
	recs, err := e.store.List(ctx, idempotency.Filter{Stale: true})
	if err != nil || len(recs) != 1 || recs[0].Key != "k" {
		t.Errorf("stale list %v (%v)", recs, err)
	}
	if n, err := e.store.StaleClaims(ctx); err != nil || n != 1 {
		t.Errorf("stale claims %d (%v)", n, err)
	}
}
