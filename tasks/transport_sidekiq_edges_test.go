package tasks

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap/zaptest"

	"github.com/onceler/onceler/internal/testkit"
	"github.com/onceler/onceler/sidekiq"
)

// The Sidekiq transport against package sidekiq's Client on a real Redis,
// where a process taken for dead (its heartbeat expired) has its working
// list recovered by another process while it still holds the job.

// sidekiqDB takes a free Redis database for the test (flushed at its end)
// and returns its URL and a client of it.
func sidekiqDB(t *testing.T) (string, *redis.Client) {
	t.Helper()
	return testkit.RedisDB(t, testkit.RedisAddr(t))
}

// recovered is a job fetched by process a through the transport (first),
// then recovered to its queue by process b, which took a for dead.
type recovered struct {
	rdb     *redis.Client
	a, b    *sidekiq.Client
	queue   string
	first   delivery
	ds      <-chan delivery
	working string // a's working list of the queue
}

// recoverScenario: a (prefetch window window) fetches one job, its
// heartbeat expires (a stalled), b recovers a's working list.
func recoverScenario(t *testing.T, window int) *recovered {
	t.Helper()
	url, rdb := sidekiqDB(t)
	r := &recovered{rdb: rdb, queue: testkit.Name("skq")}
	id := testkit.NewID()
	var err error
	r.a, err = sidekiq.New(sidekiq.Config{URL: url, Queues: []string{r.queue}, Identity: "a-" + id,
		Heartbeat: 500 * time.Millisecond, HeartbeatTTL: time.Second, FetchTimeout: time.Second, Logger: zaptest.NewLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.a.Close() })
	r.b, err = sidekiq.New(sidekiq.Config{URL: url, Queues: []string{r.queue}, Identity: "b-" + id, Logger: zaptest.NewLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.b.Close() })
	r.working = sidekiq.WorkingKey(r.a.Identity(), r.queue)

	ctx := context.Background()
	job := fmt.Sprintf(`{"class":"Billing::Charge","args":[42],"jid":"%s","queue":"%s","retry":true}`, id, r.queue)
	if err := rdb.LPush(ctx, "queue:"+r.queue, job).Err(); err != nil {
		t.Fatal(err)
	}
	tr := newSidekiqTransport[*sidekiq.Job](r.a, sidekiqView, sidekiq.ErrNotHeld, window)
	tr.count, tr.forget = r.a.CountDelivery, r.a.ForgetDeliveries
	cctx, cancel := context.WithCancel(context.Background())
	out := make(chan delivery, 10)
	done := make(chan error, 1)
	go func() { done <- tr.consume(cctx, func(d delivery) { out <- d }) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("consume: %v", err)
		}
	})
	r.ds = out
	r.first = nextDelivery(t, out)
	if r.first.stale() {
		t.Fatal("a delivery just fetched is stale")
	}
	// a stalls: its heartbeat (1 s) expires, and b recovers its jobs.
	testkit.WaitFor(t, "a's heartbeat expired", 5*time.Second, func() bool {
		n, err := rdb.Exists(ctx, r.a.Identity()).Result()
		return err == nil && n == 0
	})
	n, err := r.b.RecoverDead(ctx)
	if err != nil || n != 1 {
		t.Fatalf("b recovered %d jobs (%v), want 1", n, err)
	}
	return r
}

// TestSidekiqStaleWhenRecovered: once another process recovered the job a
// delivery holds, the delivery can no longer be settled and the job runs
// again elsewhere: it must report stale, so that the pipeline drops it
// before it runs (Worker.process, arrive, laterThen, dropStaleHeld) as it
// drops an AMQP delivery whose channel is gone. The transport learns it
// only from a settle call's ErrNotHeld, after the run.
func TestSidekiqStaleWhenRecovered(t *testing.T) {
	t.Parallel()
	r := recoverScenario(t, 1) // window 1: a fetches the job again only once its place is freed
	// The transport checks the deliveries it holds every sidekiqHeldCheck.
	deadline := time.Now().Add(10 * sidekiqHeldCheck)
	for !r.first.stale() && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if !r.first.stale() {
		t.Error("the delivery of a job recovered by another process (back on its queue, to run again) is not stale: the pipeline would run it here too")
	}
	// Its place in the window is freed (once): a fetches the job again.
	second := nextDelivery(t, r.ds)
	if second.stale() {
		t.Error("the new delivery of the recovered job is stale")
	}
	err := r.first.ack()
	if !errors.Is(err, sidekiq.ErrNotHeld) {
		t.Fatalf("ack of the recovered job: %v, want ErrNotHeld", err)
	}
	if !r.first.stale() {
		t.Error("not stale even after ErrNotHeld")
	}
	if err := second.ack(); err != nil {
		t.Errorf("the new delivery's ack: %v", err)
	}
	// Its place was freed once: the next fetch, waiting for a job, takes
	// the one place of the window (a second free would leave it at 0).
	tr := r.first.(*sidekiqDelivery[*sidekiq.Job]).t
	taken := func() int {
		tr.mu.Lock()
		defer tr.mu.Unlock()
		return tr.out
	}
	testkit.WaitFor(t, "the next fetch waiting", 5*time.Second, func() bool { return taken() == 1 })
	time.Sleep(3 * sidekiqHeldCheck)
	if n := taken(); n != 1 {
		t.Errorf("%d places of the window taken after both deliveries settled, want 1 (the fetch waiting for a job)", n)
	}
}

// TestSidekiqRecoveredIsRedelivered: a job recovered from the working list
// of a process taken for dead may have begun to run there. Its delivery
// must say so (redelivered, as RabbitMQ's flag does): the claim stage's
// crash-loop check (stage_claim.go) and the redelivery count (dbfault.go)
// read nothing else, so a job that kills its worker every time would never
// be quarantined as poison. Package sidekiq's Job carries no such mark.
func TestSidekiqRecoveredIsRedelivered(t *testing.T) {
	t.Parallel()
	r := recoverScenario(t, 2) // a fetches the recovered job again
	second := nextDelivery(t, r.ds)
	if !second.redelivered() && second.deliveryCount() == 0 {
		t.Error("the delivery of a job recovered from a dead process's working list is neither redelivered nor counted: a run of it may have begun")
	}
}

// TestSidekiqStaleSettleMissesNewDelivery: process a fetches the recovered
// job again (a new delivery of it) while it still holds the old one. A
// settle of the old delivery must not settle the new one (an AMQP delivery
// is settled by its tag on its own channel: never on a new channel). The
// client settles by the job's text (LREM of the raw element), the same in
// both: the old delivery's ack settles the new delivery, which then finds
// its job gone (ErrNotHeld) while it runs; an old giveBack or quarantine
// would likewise move the job the new delivery runs.
func TestSidekiqStaleSettleMissesNewDelivery(t *testing.T) {
	t.Parallel()
	r := recoverScenario(t, 2)
	second := nextDelivery(t, r.ds)
	ctx := context.Background()
	if n, err := r.rdb.LLen(ctx, r.working).Result(); err != nil || n != 1 {
		t.Fatalf("a's working list holds %d jobs (%v), want the new delivery's 1", n, err)
	}
	err := r.first.ack()
	if !errors.Is(err, sidekiq.ErrNotHeld) {
		t.Errorf("the old delivery's ack returned %v, want ErrNotHeld: its job went back to its queue and was fetched again", err)
	}
	if n, err := r.rdb.LLen(ctx, r.working).Result(); err != nil || n != 1 {
		t.Errorf("after the old delivery's ack a's working list holds %d jobs (%v), want 1: the new delivery's job, still unsettled, is out of it", n, err)
	}
	if err := second.ack(); err != nil {
		t.Errorf("the new delivery's ack: %v", err)
	}
}
