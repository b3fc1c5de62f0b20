package tasks

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// TestRevokedSetExpires: revoked ids are forgotten after their expiry, the
// oldest first when the set is full, and a re-revoked id lives again.
func TestRevokedSetExpires(t *testing.T) {
	t.Parallel()
	now := time.Unix(1000, 0)
	s := newRevokedSet(3, time.Hour)
	s.now = func() time.Time { return now }
	s.add("a")
	now = now.Add(30 * time.Minute)
	s.add("b")
	if !s.has("a") || !s.has("b") {
		t.Fatal("fresh ids missing")
	}
	now = now.Add(31 * time.Minute)
	if s.has("a") || !s.has("b") || s.len() != 1 {
		t.Fatalf("after 61 min: a %v b %v len %d, want a expired", s.has("a"), s.has("b"), s.len())
	}
	s.add("b") // revoked again: expires an hour from now
	now = now.Add(45 * time.Minute)
	if !s.has("b") {
		t.Fatal("re-revoked id expired early")
	}
	for _, id := range []string{"c", "d", "e"} {
		s.add(id)
	}
	if s.has("b") || !s.has("c") || !s.has("e") || s.len() != 3 {
		t.Fatalf("full set kept the oldest: len %d", s.len())
	}
	for range 1000 {
		s.add("e")
	}
	if len(s.order) > 2*s.len()+64 {
		t.Fatalf("order grew to %d entries for %d ids", len(s.order), s.len())
	}
}

// TestRevokedExpiry: a revoked id is refused (REVOKED) until
// Config.RevokedExpiry has passed; then the same id runs.
func TestRevokedExpiry(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cfg := e.config()
	cfg.RevokedExpiry = 500 * time.Millisecond
	r := e.start(testRegistry(t, &effects{}), cfg)
	replyTo, replies := e.replyQueue()
	r.w.Revoke([]string{taskID(1)}, false)
	msg := &celeryproto.Message{Protocol: 2, Task: "t.add", ID: taskID(1), Args: []any{int64(1), int64(2)}, ReplyTo: replyTo}
	e.publish(msg)
	if got := results(t, replies, 1, 20*time.Second)[taskID(1)][0]; got["status"] != "REVOKED" {
		t.Fatalf("revoked id: %v, want REVOKED", got)
	}
	time.Sleep(600 * time.Millisecond)
	e.publish(msg)
	if got := results(t, replies, 1, 20*time.Second)[taskID(1)][0]; got["status"] != "SUCCESS" {
		t.Fatalf("after the expiry: %v, want SUCCESS", got)
	}
}

// TestRevokeWhileWaiting: a task revoked after its delivery was taken up
// but before it started (here: waiting for the only database connection,
// held by another task) does not start: REVOKED, no effect, its claim gone.
func TestRevokeWhileWaiting(t *testing.T) {
	t.Parallel()
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
	t.Parallel()
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
