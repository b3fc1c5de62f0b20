package tasks

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/onceler/onceler/internal/testkit"
	"github.com/onceler/onceler/sidekiq"
)

// TestSidekiqHandBackUncounted: only deliveries whose run may have begun
// count toward the poison limit. A job handed back unrun (a give-back, or
// the jobs the worker transport's close hands back with RequeueAll) has
// that fetch taken off its counter in Redis; a job whose run began (and
// ended, or was abandoned at the end of the grace period) keeps it.
func TestSidekiqHandBackUncounted(t *testing.T) {
	t.Parallel()
	url, rdb := sidekiqDB(t)
	ctx := context.Background()
	q := testkit.Name("skq")
	id := testkit.NewID()
	names := []string{"back", "ranback", "left", "abandoned"}
	for _, n := range names {
		job := fmt.Sprintf(`{"class":"Billing::Charge","args":[1],"jid":"%s-%s","queue":"%s","retry":true}`, id, n, q)
		if err := rdb.LPush(ctx, "queue:"+q, job).Err(); err != nil {
			t.Fatal(err)
		}
	}
	counter := func(n string) string {
		v, err := rdb.Get(ctx, "onceler:deliveries:"+id+"-"+n).Result()
		if err != nil {
			return err.Error()
		}
		return v
	}
	log := zaptest.NewLogger(t)
	tr := newSidekiqWorkerTransport(&Config{Sidekiq: &sidekiq.Config{URL: url, Queues: []string{q}, FetchTimeout: time.Second},
		Prefetch: len(names), Concurrency: 1}, log, func() {})
	if err := tr.prepare(ctx); err != nil {
		t.Fatal(err)
	}
	closed := false
	t.Cleanup(func() {
		if !closed {
			_ = tr.close()
		}
	})
	cctx, cancel := context.WithCancel(ctx)
	out := make(chan delivery, 10)
	done := make(chan error, 1)
	go func() { done <- tr.consume(cctx, func(d delivery) { out <- d }) }()
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			cancel()
			if err := <-done; err != nil {
				t.Errorf("consume: %v", err)
			}
		}
	}
	t.Cleanup(stop)

	ds := map[string]*sidekiqDelivery[*sidekiq.Job]{}
	for range names {
		d := nextDelivery(t, out).(*sidekiqDelivery[*sidekiq.Job])
		ds[d.v.JID[len(id)+1:]] = d
	}
	for _, n := range names {
		if d := ds[n]; d == nil || d.deliveryCount() != 0 || counter(n) != "1" {
			t.Fatalf("first fetch of %s: %s, counter %s; want a first delivery, counted 1", n, describe(d), counter(n))
		}
	}

	// Handed back unrun: the fetch is taken off the counter.
	if err := ds["back"].giveBack(); err != nil {
		t.Fatal(err)
	}
	// Its run began (and failed to settle, say): the fetch counts.
	ds["ranback"].runStarted()
	ds["ranback"].runEnded(true)
	if err := ds["ranback"].giveBack(); err != nil {
		t.Fatal(err)
	}
	// Its run began and did not end before the stop: the fetch counts.
	ds["abandoned"].runStarted()

	// Both come back (the head of the queue) into the places freed.
	again := map[string]delivery{}
	for range 2 {
		d := nextDelivery(t, out).(*sidekiqDelivery[*sidekiq.Job])
		again[d.v.JID[len(id)+1:]] = d
	}
	if d := again["back"]; d == nil || d.redelivered() || d.deliveryCount() != 0 {
		t.Errorf("the job handed back unrun, fetched again: %s; want a first delivery (no earlier delivery counted)", describe(d))
	}
	if d := again["ranback"]; d == nil || !d.redelivered() || d.deliveryCount() != 1 {
		t.Errorf("the job handed back after its run began, fetched again: %s; want a redelivery with 1 earlier delivery", describe(d))
	}
	if got := counter("back") + " " + counter("ranback"); got != "1 2" {
		t.Errorf("counters of back and ranback fetched again: %s, want 1 2", got)
	}

	// The worker stops: its jobs go back to their queue; those whose runs
	// did not begin (back and ranback fetched again, left) are taken off
	// their counters.
	stop()
	closed = true
	if err := tr.close(); err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"back": "redis: nil", "ranback": "1", "left": "redis: nil", "abandoned": "1"}
	for _, n := range names {
		if got := counter(n); got != want[n] {
			t.Errorf("counter of %s after the stop: %s, want %s", n, got, want[n])
		}
	}
	if n, err := rdb.LLen(ctx, "queue:"+q).Result(); err != nil || n != int64(len(names)) {
		t.Errorf("queue holds %d jobs (%v) after the stop, want %d", n, err, len(names))
	}
}

// describe tells whether d is a redelivery and its count of earlier
// deliveries.
func describe[D interface {
	comparable
	delivery
}](d D) string {
	var zero D
	if d == zero {
		return "no delivery"
	}
	return fmt.Sprintf("redelivered %v, %d earlier deliveries", d.redelivered(), d.deliveryCount())
}

// TestSidekiqUncountOnce: a fetch is taken off its counter once at most,
// and only when it was counted: not when the count failed (the fetch may
// not be on the counter).
func TestSidekiqUncountOnce(t *testing.T) {
	t.Parallel()
	f := newFakeSidekiq(&sidekiqJob{Queue: "q", Class: "C", JID: "counted"}, &sidekiqJob{Queue: "q", Class: "C", JID: "failed"})
	tr := newFakeTransport(f, 2)
	var mu sync.Mutex
	var uncounted []string
	tr.count = func(_ context.Context, j *sidekiqJob) (int, error) {
		if j.JID == "failed" {
			return 1, errors.New("redis away")
		}
		return 1, nil
	}
	tr.uncount = func(_ context.Context, jobs ...*sidekiqJob) error {
		mu.Lock()
		defer mu.Unlock()
		for _, j := range jobs {
			uncounted = append(uncounted, j.JID)
		}
		return nil
	}
	ds := consumeFake(t, tr)
	a, b := nextDelivery(t, ds), nextDelivery(t, ds)
	tr.stopBacks() // stopping: the give-backs leave the jobs to close
	for _, d := range []delivery{a, b} {
		if err := d.giveBack(); err != nil {
			t.Fatal(err)
		}
	}
	for range 2 {
		if err := tr.uncountUnstarted(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if fmt.Sprint(uncounted) != "[counted]" {
		t.Errorf("uncounted %v, want [counted] once", uncounted)
	}
}
