package sidekiq

import (
	"context"
	"testing"
	"time"
)

// TestDeliveryCount: a job's fetches are counted by its jid across
// processes: 1 for the first, 2 once another process fetched it again
// after the first was given up (RequeueAll); the counter expires, and
// ForgetDeliveries removes it.
func TestDeliveryCount(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	var jid string
	e.ruby("push", map[string]any{"class": "HardWorker", "args": []any{1}, "queue": "default"}, &jid)
	a := e.client(Config{Queues: []string{"default"}})
	j := fetch(t, a, 5*time.Second)
	if n, err := a.CountDelivery(ctx, j); err != nil || n != 1 {
		t.Fatalf("first fetch counted %d (%v), want 1", n, err)
	}
	if _, err := a.RequeueAll(ctx); err != nil {
		t.Fatal(err)
	}
	b := e.client(Config{Queues: []string{"default"}})
	j2 := fetch(t, b, 5*time.Second)
	if j2.JID != jid {
		t.Fatalf("fetched %s, want %s again", j2.JID, jid)
	}
	if n, err := b.CountDelivery(ctx, j2); err != nil || n != 2 {
		t.Fatalf("second fetch counted %d (%v), want 2", n, err)
	}
	if ttl, err := e.rdb.TTL(ctx, keyDeliveriesPrefix+jid).Result(); err != nil || ttl <= 0 || ttl > deliveriesTTL {
		t.Errorf("counter TTL %v (%v), want at most %v", ttl, err, deliveriesTTL)
	}
	if err := b.Done(ctx, j2); err != nil {
		t.Fatal(err)
	}
	if err := b.ForgetDeliveries(ctx, j2); err != nil {
		t.Fatal(err)
	}
	if n, _ := e.rdb.Exists(ctx, keyDeliveriesPrefix+jid).Result(); n != 0 {
		t.Error("counter left after ForgetDeliveries")
	}
	if n, err := b.CountDelivery(ctx, &Job{}); err != nil || n != 1 {
		t.Errorf("a job without jid counted %d (%v), want 1", n, err)
	}
}

// TestUncountDeliveries: UncountDeliveries takes one fetch off each job's
// counter (twice for a job given twice), keeping the counter's expiry,
// and removes a counter that falls to 0 or was gone; a counter that is
// not an integer makes it fail without lowering any.
func TestUncountDeliveries(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	c := e.client(Config{Queues: []string{"default"}})
	twice, once, gone := &Job{JID: "twice"}, &Job{JID: "once"}, &Job{JID: "gone"}
	for _, j := range []*Job{twice, twice, twice, once} {
		if _, err := c.CountDelivery(ctx, j); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.UncountDeliveries(ctx, twice, once, gone, twice, &Job{}, nil); err != nil {
		t.Fatal(err)
	}
	if v, err := e.rdb.Get(ctx, keyDeliveriesPrefix+"twice").Result(); err != nil || v != "1" {
		t.Errorf("counter of a job counted 3 times, uncounted twice: %q (%v), want 1", v, err)
	}
	if ttl, err := e.rdb.TTL(ctx, keyDeliveriesPrefix+"twice").Result(); err != nil || ttl <= 0 || ttl > deliveriesTTL {
		t.Errorf("counter TTL %v (%v) after uncounting, want at most %v", ttl, err, deliveriesTTL)
	}
	for _, jid := range []string{"once", "gone"} {
		if n, err := e.rdb.Exists(ctx, keyDeliveriesPrefix+jid).Result(); err != nil || n != 0 {
			t.Errorf("counter of %s left after it fell to 0 or below (%v)", jid, err)
		}
	}
	if n, err := c.CountDelivery(ctx, once); err != nil || n != 1 {
		t.Errorf("fetch after the counter fell to 0 counted %d (%v), want 1", n, err)
	}
	if err := e.rdb.Set(ctx, keyDeliveriesPrefix+"bad", "x", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if err := c.UncountDeliveries(ctx, twice, &Job{JID: "bad"}); err == nil {
		t.Error("uncounting a counter that is not an integer succeeded")
	}
	if v, err := e.rdb.Get(ctx, keyDeliveriesPrefix+"twice").Result(); err != nil || v != "1" {
		t.Errorf("counter of twice after a failed uncount: %q (%v), want 1 (unchanged)", v, err)
	}
}
