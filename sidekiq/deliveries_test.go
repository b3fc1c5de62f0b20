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
