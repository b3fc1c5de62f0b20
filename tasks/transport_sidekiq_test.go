package tasks

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/testkit"
	"github.com/onceler/onceler/sidekiq"
)

// fakeSidekiq is a client of the Sidekiq transport in memory: its queue, its
// working list and the calls that settled its jobs, in order.
type fakeSidekiq struct {
	mu      sync.Mutex
	queue   []*sidekiqJob
	working map[*sidekiqJob]bool
	lost    map[*sidekiqJob]bool // recovered by another process
	// requeueFails is how many Requeue calls fail (Redis away) before
	// one succeeds; requeueGate, when set, holds each Requeue until it
	// receives.
	requeueFails int
	requeueGate  chan struct{}
	requeues     int // Requeue calls
	// fetchFails is how many Fetch calls to come fail (Redis away).
	fetchFails int
	// outcomes are Retry's outcomes by jid (Retried when absent).
	outcomes map[string]sidekiq.RetryOutcome
	calls    []string
	added    chan struct{}
}

var errFakeNotHeld = errors.New("fake: job is not in the working list")

func newFakeSidekiq(jobs ...*sidekiqJob) *fakeSidekiq {
	return &fakeSidekiq{queue: jobs, working: map[*sidekiqJob]bool{}, lost: map[*sidekiqJob]bool{}, added: make(chan struct{}, 1)}
}

func (f *fakeSidekiq) Fetch(ctx context.Context) (*sidekiqJob, error) {
	for {
		f.mu.Lock()
		if f.fetchFails > 0 {
			f.fetchFails--
			f.mu.Unlock()
			return nil, errors.New("fake: Redis away")
		}
		if len(f.queue) > 0 {
			j := f.queue[0]
			f.queue = f.queue[1:]
			f.working[j] = true
			f.mu.Unlock()
			if j.Class == "" {
				return j, errors.New("job has no class")
			}
			return j, nil
		}
		f.mu.Unlock()
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-f.added:
		}
	}
}

// take records op on j and takes j out of the working list.
func (f *fakeSidekiq) take(op string, j *sidekiqJob) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.working[j] {
		return fmt.Errorf("%s %s: %w", op, j.JID, errFakeNotHeld)
	}
	delete(f.working, j)
	f.calls = append(f.calls, op+" "+j.JID)
	return nil
}

func (f *fakeSidekiq) Done(_ context.Context, j *sidekiqJob) error { return f.take("done", j) }
func (f *fakeSidekiq) Requeue(ctx context.Context, j *sidekiqJob) error {
	if f.requeueGate != nil {
		select {
		case <-f.requeueGate:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	f.mu.Lock()
	f.requeues++
	fail := f.requeues <= f.requeueFails
	f.mu.Unlock()
	if fail {
		return errors.New("fake: redis away")
	}
	return f.take("requeue", j)
}
func (f *fakeSidekiq) Schedule(_ context.Context, j *sidekiqJob, at time.Time) error {
	if time.Until(at) < -time.Second {
		return fmt.Errorf("scheduled in the past: %s", at)
	}
	return f.take("schedule", j)
}
func (f *fakeSidekiq) Retry(_ context.Context, j *sidekiqJob, class, msg string, _ []string) (sidekiq.RetryOutcome, error) {
	if err := f.take("retry "+class+": "+msg, j); err != nil {
		return 0, err
	}
	if out, ok := f.outcomes[j.JID]; ok {
		return out, nil
	}
	return sidekiq.Retried, nil
}
func (f *fakeSidekiq) Kill(_ context.Context, j *sidekiqJob, class, msg string) error {
	return f.take("kill "+class+": "+msg, j)
}
func (f *fakeSidekiq) Close() error { return nil }

func (f *fakeSidekiq) Held(_ context.Context, jobs []*sidekiqJob) ([]bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	held := make([]bool, len(jobs))
	for i, j := range jobs {
		held[i] = !f.lost[j]
	}
	return held, nil
}

func (f *fakeSidekiq) callLog() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.calls...)
}

// lose takes j out of the working list, as another process recovering it
// does.
func (f *fakeSidekiq) lose(j *sidekiqJob) {
	f.mu.Lock()
	delete(f.working, j)
	f.lost[j] = true
	f.mu.Unlock()
}

func newFakeTransport(f *fakeSidekiq, prefetch int) *sidekiqTransport[*sidekiqJob] {
	return newSidekiqTransport[*sidekiqJob](f, func(j *sidekiqJob) sidekiqJob { return *j }, errFakeNotHeld, prefetch)
}

// consumeFake runs t.consume until the test ends, handing the deliveries
// to the channel returned.
func consumeFake(t *testing.T, tr *sidekiqTransport[*sidekiqJob]) <-chan delivery {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	out := make(chan delivery, 100)
	done := make(chan error, 1)
	go func() { done <- tr.consume(ctx, func(d delivery) { out <- d }) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("consume returned %v after its context ended, want nil", err)
		}
	})
	return out
}

func nextDelivery(t *testing.T, ds <-chan delivery) delivery {
	t.Helper()
	select {
	case d := <-ds:
		return d
	case <-time.After(5 * time.Second):
		t.Fatal("no delivery within 5 s")
		return nil
	}
}

func noDelivery(t *testing.T, ds <-chan delivery, why string) {
	t.Helper()
	select {
	case d := <-ds:
		t.Fatalf("%s: got a delivery of %s", why, d.origin().Queue)
	case <-time.After(150 * time.Millisecond):
	}
}

// TestSidekiqWireForm: a Sidekiq job reaches the decode stage as a Celery
// message: task name its class, id its jid, its arguments with integers
// and floats as they were sent, retries its retry_count + 1, and its
// idempotency key where the bind stage reads it. A job the client could
// not decode is refused by the Celery decoder, naming why.
func TestSidekiqWireForm(t *testing.T) {
	t.Parallel()
	dec := celeryproto.NewDecoder(celeryproto.Limits{})
	j := sidekiqJob{Queue: "default", Class: "Billing::Charge", JID: "b1c2d3", IdempotencyKey: "order-42",
		Args:       []any{json.Number("42"), "x", nil, map[string]any{"amount": json.Number("9.5"), "ids": []any{json.Number("7")}}},
		RetryCount: 2}
	m, err := dec.Decode(sidekiqWire(j, nil))
	if err != nil {
		t.Fatal(err)
	}
	if m.Task != j.Class || m.ID != j.JID || m.Retries != 3 || m.Headers["idempotency_key"] != "order-42" {
		t.Errorf("decoded task %q id %q retries %d idempotency_key %v, want %q %q 3 order-42",
			m.Task, m.ID, m.Retries, m.Headers["idempotency_key"], j.Class, j.JID)
	}
	if len(m.Args) != 4 || m.Args[0] != int64(42) || m.Args[1] != "x" || m.Args[2] != nil {
		t.Fatalf("args %#v, want [42 x nil {...}]", m.Args)
	}
	kw, _ := m.Args[3].(map[string]any)
	if ids, _ := kw["ids"].([]any); kw["amount"] != 9.5 || len(ids) != 1 || ids[0] != int64(7) {
		t.Errorf("args[3] = %#v, want amount 9.5 and ids [7]", m.Args[3])
	}
	if fresh, err := dec.Decode(sidekiqWire(sidekiqJob{Class: "C", JID: "j", RetryCount: -1}, nil)); err != nil || fresh.Retries != 0 || len(fresh.Args) != 0 {
		t.Errorf("a job never retried, without arguments: %+v, %v; want retries 0, no args", fresh, err)
	}

	_, err = dec.Decode(sidekiqWire(sidekiqJob{Queue: "default"}, errors.New("job has no class")))
	if !errors.Is(err, celeryproto.ErrBadHeader) || !strings.Contains(err.Error(), "job has no class") {
		t.Errorf("an undecodable job decoded with %v, want ErrBadHeader naming the cause", err)
	}
}

// TestSidekiqWindow: the transport holds at most the prefetch window's
// jobs unsettled, and the memory budget's cap lowers it.
func TestSidekiqWindow(t *testing.T) {
	t.Parallel()
	var jobs []*sidekiqJob
	for i := range 6 {
		jobs = append(jobs, &sidekiqJob{Queue: "q", Class: "C", JID: fmt.Sprint("j", i), RetryCount: -1})
	}
	f := newFakeSidekiq(jobs...)
	tr := newFakeTransport(f, 2)
	ds := consumeFake(t, tr)
	a, b := nextDelivery(t, ds), nextDelivery(t, ds)
	noDelivery(t, ds, "two unsettled under a window of 2")
	if err := a.ack(); err != nil {
		t.Fatal(err)
	}
	c := nextDelivery(t, ds)
	if err := tr.setWindowLimit(1); err != nil {
		t.Fatal(err)
	}
	if err := b.ack(); err != nil {
		t.Fatal(err)
	}
	noDelivery(t, ds, "one unsettled under a cap of 1")
	if err := c.giveBack(); err != nil {
		t.Fatal(err)
	}
	d := nextDelivery(t, ds)
	if err := tr.setWindowLimit(0); err != nil {
		t.Fatal(err)
	}
	e := nextDelivery(t, ds)
	noDelivery(t, ds, "two unsettled, the cap removed")
	for _, x := range []delivery{d, e} {
		if err := x.ack(); err != nil {
			t.Fatal(err)
		}
	}
	want := []string{"done j0", "done j1", "requeue j2", "done j3", "done j4"}
	if got := f.callLog(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("calls %v, want %v", got, want)
	}
}

// TestSidekiqSettle: each move settles the job once at the client (the ack
// after it sends nothing), and a job another process took back is stale
// before any settle, its ack not sent.
func TestSidekiqSettle(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	jobs := []*sidekiqJob{
		{Queue: "q", Class: "C", JID: "quarantined"}, {Queue: "q", Class: "C", JID: "retried"},
		{Queue: "q", Class: "C", JID: "scheduled"}, {Queue: "q", Class: "C", JID: "lost"},
	}
	f := newFakeSidekiq(jobs...)
	tr := newFakeTransport(f, 10)
	ds := consumeFake(t, tr)
	q, r, s, l := nextDelivery(t, ds), nextDelivery(t, ds), nextDelivery(t, ds), nextDelivery(t, ds)

	if err := q.quarantine(ctx, map[string]any{HeaderReason: ReasonPoison, HeaderDetail: "delivered 6 times"}); err != nil {
		t.Fatal(err)
	}
	if err := r.retry(ctx, nil, &RetryRequest{Countdown: time.Second, Cause: &PythonError{Type: "IOError", Module: "builtins", Message: "gateway away"}}); err != nil {
		t.Fatal(err)
	}
	if err := s.republish(ctx, time.Time{}); err != nil {
		t.Fatal(err)
	}
	for _, d := range []delivery{q, r, s} {
		if err := d.ack(); err != nil {
			t.Errorf("ack after a move: %v", err)
		}
	}
	f.lose(jobs[3])
	testkit.WaitFor(t, "the delivery of the lost job stale", 10*sidekiqHeldCheck, l.stale)
	if err := l.ack(); !errors.Is(err, errFakeNotHeld) || !l.stale() {
		t.Errorf("ack of a job recovered by another process: %v, stale %v; want not held, stale", err, l.stale())
	}
	want := []string{"kill Onceler::Poison: delivered 6 times quarantined", "retry IOError: gateway away retried", "schedule scheduled"}
	if got := f.callLog(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("calls %q, want %q", got, want)
	}
	tr.mu.Lock()
	out := tr.out
	tr.mu.Unlock()
	if out != 1 {
		t.Errorf("%d places in the window taken, want 1 (the fetch waiting for a fifth job)", out)
	}
}

// TestSidekiqDeliveryCount: a job fetched again (recovered from a dead
// process, handed back) is a redelivery with the transport's own count of
// its earlier deliveries; a count that fails makes it a redelivery of
// unknown count; the counter is forgotten when the job is settled for
// good, not when it is handed back.
func TestSidekiqDeliveryCount(t *testing.T) {
	t.Parallel()
	j := &sidekiqJob{Queue: "q", Class: "C", JID: "again", RetryCount: -1}
	broken := &sidekiqJob{Queue: "q", Class: "C", JID: "uncounted", RetryCount: -1}
	f := newFakeSidekiq(j, j, broken)
	tr := newFakeTransport(f, 1)
	var mu sync.Mutex
	counts := map[string]int{}
	var forgotten []string
	tr.count = func(_ context.Context, j *sidekiqJob) (int, error) {
		mu.Lock()
		defer mu.Unlock()
		if j.JID == "uncounted" {
			return 1, errors.New("redis away")
		}
		counts[j.JID]++
		return counts[j.JID], nil
	}
	tr.forget = func(_ context.Context, j *sidekiqJob) error {
		mu.Lock()
		defer mu.Unlock()
		delete(counts, j.JID)
		forgotten = append(forgotten, j.JID)
		return nil
	}
	ds := consumeFake(t, tr)
	first := nextDelivery(t, ds)
	if first.redelivered() || first.deliveryCount() != 0 {
		t.Errorf("first fetch: redelivered %v count %d, want false 0", first.redelivered(), first.deliveryCount())
	}
	if err := first.giveBack(); err != nil {
		t.Fatal(err)
	}
	second := nextDelivery(t, ds)
	if !second.redelivered() || second.deliveryCount() != 1 {
		t.Errorf("second fetch: redelivered %v count %d, want true 1", second.redelivered(), second.deliveryCount())
	}
	mu.Lock()
	if len(forgotten) != 0 {
		t.Errorf("forgotten after a hand-back: %v, want none", forgotten)
	}
	mu.Unlock()
	if err := second.ack(); err != nil {
		t.Fatal(err)
	}
	third := nextDelivery(t, ds)
	if !third.redelivered() || third.deliveryCount() != 0 {
		t.Errorf("fetch whose count failed: redelivered %v count %d, want true 0", third.redelivered(), third.deliveryCount())
	}
	mu.Lock()
	defer mu.Unlock()
	if fmt.Sprint(forgotten) != "[again]" || len(counts) != 0 {
		t.Errorf("forgotten %v, counters left %v; want [again] forgotten once settled", forgotten, counts)
	}
}

// TestSidekiqGiveBackOffTheLock: a give-back returns at once (the worker
// calls it holding its lock) while the client's Requeue waits on Redis;
// one that fails is tried again until it succeeds, and the job's place in
// the window is freed only then.
func TestSidekiqGiveBackOffTheLock(t *testing.T) {
	t.Parallel()
	f := newFakeSidekiq(&sidekiqJob{Queue: "q", Class: "C", JID: "back"}, &sidekiqJob{Queue: "q", Class: "C", JID: "next"})
	f.requeueFails = 2
	f.requeueGate = make(chan struct{})
	tr := newFakeTransport(f, 1)
	ds := consumeFake(t, tr)
	d := nextDelivery(t, ds)
	returned := make(chan error, 1)
	go func() { returned <- d.giveBack() }()
	select {
	case err := <-returned:
		if err != nil {
			t.Fatalf("giveBack: %v", err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("giveBack waits for the client's Requeue")
	}
	noDelivery(t, ds, "the give-back is not over: the job's place is taken")
	for range 3 {
		select {
		case f.requeueGate <- struct{}{}:
		case <-time.After(5 * time.Second):
			t.Fatal("a failed give-back is not tried again")
		}
	}
	next := nextDelivery(t, ds)
	if err := next.ack(); err != nil {
		t.Fatal(err)
	}
	want := []string{"requeue back", "done next"}
	if got := f.callLog(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("calls %q, want %q", got, want)
	}
}

// TestSidekiqGiveBackEndsAtClose: a give-back that keeps failing is tried
// until the transport closes, which does not wait longer for it (the job
// stays in the working list, for close's RequeueAll or another process).
func TestSidekiqGiveBackEndsAtClose(t *testing.T) {
	t.Parallel()
	f := newFakeSidekiq(&sidekiqJob{Queue: "q", Class: "C", JID: "stuck"})
	f.requeueFails = 1 << 30
	tr := newFakeTransport(f, 1)
	ds := consumeFake(t, tr)
	d := nextDelivery(t, ds)
	if err := d.giveBack(); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, "the give-back tried twice", 5*time.Second, func() bool {
		f.mu.Lock()
		defer f.mu.Unlock()
		return f.requeues >= 2
	})
	closed := make(chan error, 1)
	go func() { closed <- tr.close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("close waits for a give-back that keeps failing")
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.working[d.(*sidekiqDelivery[*sidekiqJob]).job] {
		t.Error("the job whose give-back failed left the working list")
	}
}

// TestSidekiqRetryOutcome: the delivery tells where Sidekiq's retry sent
// the job: retried, or ended (dead set, discarded).
func TestSidekiqRetryOutcome(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFakeSidekiq(&sidekiqJob{Queue: "q", Class: "C", JID: "again"}, &sidekiqJob{Queue: "q", Class: "C", JID: "dead"},
		&sidekiqJob{Queue: "q", Class: "C", JID: "dropped"})
	f.outcomes = map[string]sidekiq.RetryOutcome{"dead": sidekiq.Dead, "dropped": sidekiq.Discarded}
	tr := newFakeTransport(f, 3)
	ds := consumeFake(t, tr)
	for range 3 {
		d := nextDelivery(t, ds).(*sidekiqDelivery[*sidekiqJob])
		var err error
		if d.v.JID == "dropped" {
			err = d.retry(ctx, nil, &RetryRequest{Countdown: time.Second})
		} else {
			err = d.failed(ctx, "RuntimeError", "boom", nil)
		}
		if err != nil {
			t.Fatal(err)
		}
		want := map[string]sidekiq.RetryOutcome{"again": sidekiq.Retried, "dead": sidekiq.Dead, "dropped": sidekiq.Discarded}[d.v.JID]
		if got := d.retryOutcome(); got != want {
			t.Errorf("%s: outcome %v, want %v", d.v.JID, got, want)
		}
	}
}

// TestSidekiqFetchFailuresCounted: fetches that fail are tried again,
// counted in onceler_receive_failures_total, and the job waiting behind
// them is still delivered.
func TestSidekiqFetchFailuresCounted(t *testing.T) {
	t.Parallel()
	f := newFakeSidekiq(&sidekiqJob{Queue: "default", Class: "Billing::Charge", JID: "j1"})
	f.fetchFails = 2
	m, err := newMetrics(nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	tr := newFakeTransport(f, 4)
	tr.failed = m.recvFails.Inc
	ds := consumeFake(t, tr)
	if d := nextDelivery(t, ds); d.origin().Queue != "default" {
		t.Fatalf("delivered from %q, want default", d.origin().Queue)
	}
	if got := counterValue(m.recvFails); got != 2 {
		t.Fatalf("onceler_receive_failures_total = %v, want 2", got)
	}
}
