package amqp

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

func TestConsumeAndAck(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t)
	q := testenv.Name("onceler_amqp_ack")
	cleanupQueue(t, q)
	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQueue(q)}, Prefetch: 10})
	got := make(chan *Delivery, 100)
	runConsumer(t, c, func(d *Delivery) { got <- d })
	testkit.WaitFor(t, "consumer ready", 10*time.Second, c.Ready)

	p := newPublisher(t, cfg)
	ctx := ctxTimeout(t, 20*time.Second)
	const n = 20
	for i := range n {
		msg := textMessage(fmt.Sprintf(`{"i": %d}`, i))
		msg.CorrelationID = fmt.Sprint(i)
		msg.Headers = map[string]any{"task": "t.add", "retries": int64(i)}
		// Through the exchange of the same name, as kombu routes.
		must(t, p.Publish(ctx, q, q, msg, PublishOptions{Mandatory: true}), "publish %d", i)
	}
	for i := range n {
		d := recv(t, got, 10*time.Second)
		if d.Queue != q || d.Exchange != q || d.RoutingKey != q {
			t.Fatalf("delivery routing = %q/%q/%q, want %q everywhere", d.Queue, d.Exchange, d.RoutingKey, q)
		}
		if d.CorrelationID != fmt.Sprint(i) || string(d.Body) != fmt.Sprintf(`{"i": %d}`, i) {
			t.Fatalf("delivery %d: correlation %q body %q", i, d.CorrelationID, d.Body)
		}
		if d.Headers["task"] != "t.add" || d.Headers["retries"] != int64(i) || d.DeliveryMode != 2 || d.Redelivered {
			t.Fatalf("delivery %d: headers %v mode %d redelivered %t", i, d.Headers, d.DeliveryMode, d.Redelivered)
		}
		must(t, d.Ack(), "ack %d", i)
		if err := d.Ack(); !errors.Is(err, ErrAlreadySettled) {
			t.Fatalf("second ack: %v, want ErrAlreadySettled", err)
		}
	}
	testkit.WaitFor(t, "queue empty", 5*time.Second, func() bool { return testkit.QueueDepth(t, testenv.AMQPURL(t), q) == 0 })
	// The channel survived the refused double acks: consuming goes on.
	must(t, p.Publish(ctx, "", q, textMessage(`"last"`), PublishOptions{}), "publish last")
	must(t, recv(t, got, 10*time.Second).Ack(), "ack last")
}

// An unacknowledged delivery goes back to the queue when its channel
// closes, and comes again with redelivered set; its old tag is stale.
func TestLateAckRedelivered(t *testing.T) {
	cfg, q, p, ctx := declaredQueue(t, "onceler_amqp_late", 30*time.Second)
	must(t, p.Publish(ctx, "", q, textMessage(`"late"`), PublishOptions{}), "publish")

	got := make(chan *Delivery, 10)
	c1 := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQueue(q)}})
	stop1 := runConsumer(t, c1, func(d *Delivery) { got <- d })
	first := recv(t, got, 10*time.Second)
	if first.Redelivered {
		t.Fatal("first delivery marked redelivered")
	}
	must(t, stop1(), "stop first consumer")
	if c1.Ready() {
		t.Fatal("Ready after Run returned")
	}
	if err := first.Ack(); !errors.Is(err, ErrStaleDelivery) {
		t.Fatalf("ack after channel close = %v, want ErrStaleDelivery", err)
	}
	if !first.Stale() {
		t.Fatal("Stale() false after channel close")
	}

	c2 := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQueue(q)}})
	runConsumer(t, c2, func(d *Delivery) { got <- d })
	again := recv(t, got, 10*time.Second)
	if !again.Redelivered || string(again.Body) != `"late"` {
		t.Fatalf("redelivery: redelivered=%t body=%q", again.Redelivered, again.Body)
	}
	must(t, again.Ack(), "ack redelivery")
	testkit.WaitFor(t, "queue empty", 5*time.Second, func() bool { return testkit.QueueDepth(t, testenv.AMQPURL(t), q) == 0 })
}

// The broker closes the consumer's connection: Run reconnects and resumes,
// the old delivery is stale and comes back.
func TestReconnectAfterBrokerClosesConnection(t *testing.T) {
	cfg := testConfig(t)
	q := testenv.Name("onceler_amqp_reconnect")
	cleanupQueue(t, q)
	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQueue(q)}, Prefetch: 5})
	got := make(chan *Delivery, 10)
	stop := runConsumer(t, c, func(d *Delivery) { got <- d })
	testkit.WaitFor(t, "consumer ready", 10*time.Second, c.Ready)
	must(t, c.SetPrefetch(7), "set prefetch")

	p := newPublisher(t, cfg)
	ctx := ctxTimeout(t, 30*time.Second)
	must(t, p.Publish(ctx, "", q, textMessage(`"one"`), PublishOptions{Mandatory: true}), "publish")
	old := recv(t, got, 10*time.Second)

	if n := closeConnection(t, cfg.Name+" consume"); n != 1 {
		t.Fatalf("closed %d consumer connections, want 1", n)
	}
	back := recv(t, got, 15*time.Second)
	if !back.Redelivered || string(back.Body) != `"one"` {
		t.Fatalf("after reconnect: redelivered=%t body=%q", back.Redelivered, back.Body)
	}
	if !c.Ready() {
		t.Fatal("not Ready after resuming")
	}
	if err := old.Ack(); !errors.Is(err, ErrStaleDelivery) {
		t.Fatalf("ack of the pre-reconnect delivery = %v, want ErrStaleDelivery", err)
	}
	if c.Prefetch() != 7 {
		t.Fatalf("prefetch after reconnect = %d, want 7", c.Prefetch())
	}
	must(t, back.Ack(), "ack redelivery")
	must(t, p.Publish(ctx, "", q, textMessage(`"two"`), PublishOptions{}), "publish after reconnect")
	must(t, recv(t, got, 10*time.Second).Ack(), "ack two")
	testkit.WaitFor(t, "queue empty", 5*time.Second, func() bool { return testkit.QueueDepth(t, testenv.AMQPURL(t), q) == 0 })
	must(t, stop(), "stop")
}

func TestPrefetchWindowAndSetPrefetch(t *testing.T) {
	t.Parallel()
	cfg, q, p, ctx := declaredQueue(t, "onceler_amqp_qos", 30*time.Second)
	for i := range 5 {
		must(t, p.Publish(ctx, "", q, textMessage(fmt.Sprint(i)), PublishOptions{}), "publish")
	}
	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQueue(q)}, Prefetch: 2})
	got := make(chan *Delivery, 10)
	runConsumer(t, c, func(d *Delivery) { got <- d })
	held := []*Delivery{recv(t, got, 10*time.Second), recv(t, got, 5*time.Second)}
	noRecv(t, got, 300*time.Millisecond)
	// Grow the window as the worker does for held ETA tasks.
	must(t, c.SetPrefetch(4), "grow prefetch")
	held = append(held, recv(t, got, 5*time.Second), recv(t, got, 5*time.Second))
	noRecv(t, got, 300*time.Millisecond)
	for _, d := range held {
		must(t, d.Ack(), "ack")
	}
	must(t, recv(t, got, 5*time.Second).Ack(), "ack last")
	if err := c.SetPrefetch(70000); !errors.Is(err, ErrConfig) {
		t.Fatalf("SetPrefetch(70000) = %v, want ErrConfig", err)
	}
}

// SetWindowLimit caps the prefetch window below what SetPrefetch asks (a
// worker short of memory), and removing the cap restores it.
func TestSetWindowLimit(t *testing.T) {
	t.Parallel()
	cfg, q, p, ctx := declaredQueue(t, "onceler_amqp_window", 30*time.Second)
	for i := range 6 {
		must(t, p.Publish(ctx, "", q, textMessage(fmt.Sprint(i)), PublishOptions{}), "publish")
	}
	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQueue(q)}, Prefetch: 5})
	must(t, c.SetWindowLimit(1), "limit before Run")
	got := make(chan *Delivery, 10)
	runConsumer(t, c, func(d *Delivery) { got <- d })
	held := []*Delivery{recv(t, got, 10*time.Second)}
	noRecv(t, got, 300*time.Millisecond)
	must(t, c.SetPrefetch(4), "prefetch under the limit")
	noRecv(t, got, 300*time.Millisecond)
	if n := c.Prefetch(); n != 1 {
		t.Fatalf("prefetch in force %d, want the limit 1", n)
	}
	must(t, c.SetWindowLimit(0), "remove the limit")
	held = append(held, recv(t, got, 5*time.Second), recv(t, got, 5*time.Second), recv(t, got, 5*time.Second))
	noRecv(t, got, 300*time.Millisecond)
	for _, d := range held {
		must(t, d.Ack(), "ack")
	}
	must(t, recv(t, got, 5*time.Second).Ack(), "ack")
	must(t, recv(t, got, 5*time.Second).Ack(), "ack")
}

// With DrainTimeout, deliveries handed out before shutdown can still be
// acknowledged; what the broker sends after the cancel goes back.
func TestDrainOnShutdown(t *testing.T) {
	cfg, q, p, ctx := declaredQueue(t, "onceler_amqp_drain", 30*time.Second)
	must(t, p.Publish(ctx, "", q, textMessage(`"a"`), PublishOptions{}), "publish")

	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQueue(q)}, Prefetch: 1, DrainTimeout: 10 * time.Second})
	got := make(chan *Delivery, 10)
	runCtx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx, func(d *Delivery) { got <- d }) }()
	d := recv(t, got, 10*time.Second)
	must(t, p.Publish(ctx, "", q, textMessage(`"b"`), PublishOptions{}), "publish b")
	cancel()
	time.Sleep(200 * time.Millisecond)
	select {
	case err := <-done:
		t.Fatalf("Run returned (%v) with a delivery unsettled", err)
	default:
	}
	must(t, d.Ack(), "ack during drain")
	select {
	case err := <-done:
		must(t, err, "Run")
	case <-time.After(5 * time.Second):
		t.Fatal("Run did not return after the last ack")
	}
	noRecv(t, got, 50*time.Millisecond)
	if n := testkit.QueueDepth(t, testenv.AMQPURL(t), q); n != 1 {
		t.Fatalf("queue depth after drain = %d, want 1 (message b back in the queue)", n)
	}
}

func TestConsumeSeveralQueues(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t)
	q1, q2 := testenv.Name("onceler_amqp_multi"), testenv.Name("onceler_amqp_multi")
	cleanupQueue(t, q1, q2)
	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQueue(q1), CeleryQueue(q2)}})
	got := make(chan *Delivery, 10)
	runConsumer(t, c, func(d *Delivery) { got <- d })
	testkit.WaitFor(t, "consumer ready", 10*time.Second, c.Ready)
	p := newPublisher(t, cfg)
	ctx := ctxTimeout(t, 20*time.Second)
	must(t, p.Publish(ctx, q1, q1, textMessage("1"), PublishOptions{Mandatory: true}), "publish q1")
	must(t, p.Publish(ctx, q2, q2, textMessage("2"), PublishOptions{Mandatory: true}), "publish q2")
	seen := map[string]string{}
	for range 2 {
		d := recv(t, got, 10*time.Second)
		seen[d.Queue] = string(d.Body)
		must(t, d.Ack(), "ack")
	}
	if seen[q1] != "1" || seen[q2] != "2" {
		t.Fatalf("deliveries by queue = %v", seen)
	}
}

// The queue is deleted under the consumer: the broker cancels it, Run
// declares the queue again and consumes from the new one.
func TestQueueDeletedRedeclared(t *testing.T) {
	cfg := testConfig(t)
	q := testenv.Name("onceler_amqp_deleted")
	cleanupQueue(t, q)
	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQueue(q)}})
	got := make(chan *Delivery, 10)
	runConsumer(t, c, func(d *Delivery) { got <- d })
	testkit.WaitFor(t, "consumer ready", 10*time.Second, c.Ready)
	p := newPublisher(t, cfg)
	ctx := ctxTimeout(t, 30*time.Second)
	_, err := p.DeleteQueue(ctx, q)
	must(t, err, "delete queue")
	// Until Run re-declares, a mandatory publish has no queue to go to.
	deadline := time.Now().Add(15 * time.Second)
	for {
		err := p.Publish(ctx, q, q, textMessage(`"after"`), PublishOptions{Mandatory: true})
		if err == nil {
			break
		}
		if !errors.Is(err, ErrReturned) || time.Now().After(deadline) {
			t.Fatalf("publish after delete: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	d := recv(t, got, 10*time.Second)
	if string(d.Body) != `"after"` {
		t.Fatalf("body %q", d.Body)
	}
	must(t, d.Ack(), "ack")
}

// Acks from many goroutines while the connection is closed under them:
// acks either succeed or report ErrStaleDelivery, and every message ends
// up acknowledged once the consumer has reconnected.
func TestConcurrentAcksAcrossReconnect(t *testing.T) {
	cfg, q, p, ctx := declaredQueue(t, "onceler_amqp_acks", 60*time.Second)
	const n = 1000
	for i := range n {
		must(t, p.Publish(ctx, "", q, textMessage(fmt.Sprint(i)), PublishOptions{}), "publish")
	}
	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQueue(q)}, Prefetch: 50})
	work := make(chan *Delivery, 100)
	var (
		mu    sync.Mutex
		acked = map[string]bool{}
		stale int
		other []error
	)
	count := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(acked)
	}
	// After 100 acks the workers hold what they have until the connection
	// was closed, so those acks are certainly stale.
	gate := make(chan struct{})
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for d := range work {
				if count() >= 100 {
					<-gate
				}
				err := d.Ack()
				mu.Lock()
				switch {
				case err == nil:
					acked[string(d.Body)] = true
				case errors.Is(err, ErrStaleDelivery):
					stale++
				default:
					other = append(other, err)
				}
				mu.Unlock()
			}
		}()
	}
	stop := runConsumer(t, c, func(d *Delivery) { work <- d })
	testkit.WaitFor(t, "100 acks", 20*time.Second, func() bool { return count() >= 100 })
	if k := closeConnection(t, cfg.Name+" consume"); k != 1 {
		t.Fatalf("closed %d consumer connections", k)
	}
	close(gate)
	testkit.WaitFor(t, "every message acknowledged", 40*time.Second, func() bool { return count() == n })
	must(t, stop(), "stop")
	close(work)
	wg.Wait()
	if len(other) > 0 {
		t.Fatalf("%d acks failed otherwise, first: %v", len(other), other[0])
	}
	t.Logf("acked %d distinct, %d stale acks refused", count(), stale)
	if stale == 0 {
		t.Fatal("no ack was refused as stale although deliveries were held across the close")
	}
	if d := testkit.QueueDepth(t, testenv.AMQPURL(t), q); d != 0 {
		t.Fatalf("queue depth %d after all acks", d)
	}
}

// Acknowledgements are coalesced into multiple acks, but only over settled
// deliveries: with the first delivery held unsettled (a slow task) the
// others are still acknowledged (on their own once the linger is over), the
// prefetch window keeps moving, and when the channel closes exactly the
// unsettled one comes back. Deliveries settled nearly in order go out as
// fewer frames than acks (how many fewer depends on how many settle while
// a frame is written; TestAckerCoalescesInOrderRuns measures it).
func TestCoalescedAcksAroundASlowDelivery(t *testing.T) {
	t.Parallel()
	cfg, q, p, ctx := declaredQueue(t, "onceler_amqp_coalesce", 60*time.Second)
	const n = 400
	publish := func(from int) {
		for i := from; i < from+n; i++ {
			must(t, p.Publish(ctx, "", q, textMessage(fmt.Sprint(i)), PublishOptions{}), "publish %d", i)
		}
	}
	publish(0)
	got := make(chan *Delivery, n)
	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQueue(q)}, Prefetch: 40, DrainTimeout: 300 * time.Millisecond})
	stop := runConsumer(t, c, func(d *Delivery) { got <- d })

	slow := recv(t, got, 10*time.Second)
	if string(slow.Body) != "0" {
		t.Fatalf("first delivery %q", slow.Body)
	}
	// The others, settled by 4 goroutines as they come (nearly in order);
	// every 50th is nacked with requeue the first time.
	settleAll := func(got <-chan *Delivery, want int) {
		t.Helper()
		var wg sync.WaitGroup
		var mu sync.Mutex
		seen := map[string]bool{}
		acked := 0
		done := make(chan struct{})
		for range 4 {
			wg.Go(func() {
				for {
					var d *Delivery
					select {
					case d = <-got:
					case <-done:
						return
					case <-ctx.Done():
						return
					}
					var i int
					_, _ = fmt.Sscan(string(d.Body), &i)
					mu.Lock()
					first := !seen[string(d.Body)]
					seen[string(d.Body)] = true
					mu.Unlock()
					if first && i%50 == 25 {
						must(t, d.Nack(true), "nack %d", i)
						continue
					}
					must(t, d.Ack(), "ack %d", i)
					mu.Lock()
					acked++
					if acked == want {
						close(done)
					}
					mu.Unlock()
				}
			})
		}
		wg.Wait()
		if acked != want {
			t.Fatalf("acked %d of %d", acked, want)
		}
	}
	settleAll(got, n-1)
	// Stop with the first still unsettled: only it comes back.
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	c2 := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQueue(q)}, Prefetch: 40})
	again := make(chan *Delivery, 2*n)
	runConsumer(t, c2, func(d *Delivery) { again <- d })
	d := recv(t, again, 10*time.Second)
	if string(d.Body) != "0" || !d.Redelivered {
		t.Fatalf("redelivered %q (redelivered=%t), want only the unsettled first message", d.Body, d.Redelivered)
	}
	noRecv(t, again, 500*time.Millisecond)
	must(t, d.Ack(), "ack the first")
	before := d.ch.acks.counters()
	publish(n)
	settleAll(again, n)
	testkit.WaitFor(t, "queue empty", 5*time.Second, func() bool { return testkit.QueueDepth(t, testenv.AMQPURL(t), q) == 0 })
	after := d.ch.acks.counters()
	acks, frames := after.acks-before.acks, after.frames-before.frames
	if acks != n || frames >= acks {
		t.Fatalf("%d acks in %d frames, want fewer frames than acks", acks, frames)
	}
	t.Logf("%d acks in %d frames", acks, frames)
}
