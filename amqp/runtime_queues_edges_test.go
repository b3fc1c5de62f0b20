package amqp

import (
	"context"
	"errors"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// TestAddQueueBadExchangeTypeKeepsConsuming: add_consumer with an
// exchange_type the broker does not know (Celery's add_consumer passes
// exchange_type through) must be refused without touching the consuming
// connection: a delivery held unacknowledged meanwhile (a running task)
// must still be acknowledged on its channel, not returned to the queue and
// redelivered.
func TestAddQueueBadExchangeTypeKeepsConsuming(t *testing.T) {
	cfg, q1, p, ctx := declaredQueue(t, "onceler_amqp_badx", 60*time.Second)
	q2 := testenv.Name("onceler_amqp_badx")
	cleanupQueue(t, q2)
	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQueue(q1)}, Prefetch: 4})
	got := make(chan *Delivery, 10)
	runConsumer(t, c, func(d *Delivery) { got <- d })
	testkit.WaitFor(t, "consumer ready", 10*time.Second, c.Ready)
	must(t, p.Publish(ctx, q1, q1, textMessage("held"), PublishOptions{Mandatory: true}), "publish")
	held := recv(t, got, 10*time.Second)

	err := c.AddQueue(QueueSpec{Name: q2, Exchange: q2, ExchangeType: "bogus", RoutingKey: q2, Durable: true})
	if err == nil {
		t.Error("AddQueue with exchange type bogus succeeded")
	}
	heldSurvives(t, c, held, got, "a refused add_consumer")
}

// TestAddQueueWhileReconnectingRefusedQueue: add_consumer of a queue the
// consumer cannot serve (a stream queue), sent while the consumer is
// between connections, must not be answered "ok" and then end the
// consumer: either AddQueue reports the refusal, or the consumer goes on
// consuming its configured queue.
func TestAddQueueWhileReconnectingRefusedQueue(t *testing.T) {
	cfg, q1, p, ctx := declaredQueue(t, "onceler_amqp_addrc", 90*time.Second)
	cfg.MinBackoff, cfg.MaxBackoff = 30*time.Second, 30*time.Second // a reconnect waits 15..30 s
	stream := testenv.Name("onceler_amqp_stream")
	cleanupQueue(t, stream)
	conn, err := amqp091.Dial(cfg.URL)
	must(t, err, "dial")
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	must(t, err, "channel")
	_, err = ch.QueueDeclare(stream, true, false, false, false, amqp091.Table{"x-queue-type": "stream"})
	must(t, err, "declare stream queue")

	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQueue(q1)}, Prefetch: 4})
	got := make(chan *Delivery, 10)
	cctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- c.Run(cctx, func(d *Delivery) { got <- d }) }()
	defer func() {
		cancel()
		select {
		case <-done:
		case <-time.After(60 * time.Second):
			t.Error("consumer did not stop")
		}
	}()
	testkit.WaitFor(t, "consumer ready", 10*time.Second, c.Ready)
	if closeConnection(t, cfg.Name+" consume") != 1 {
		t.Fatal("no connection to close")
	}
	testkit.WaitFor(t, "consumer disconnected", 10*time.Second, func() bool { return !c.Ready() })

	addErr := c.AddQueue(CeleryQueue(stream))
	t.Logf("AddQueue(stream queue) while reconnecting = %v", addErr)

	must(t, p.Publish(ctx, q1, q1, textMessage("after"), PublishOptions{Mandatory: true}), "publish")
	select {
	case d := <-got:
		must(t, d.Ack(), "ack")
	case err := <-done:
		done <- err
		if addErr == nil {
			t.Fatalf("add_consumer of a stream queue while reconnecting was accepted (nil), then the consumer stopped: %v", err)
		}
	case <-time.After(60 * time.Second):
		if addErr == nil {
			t.Fatal("add_consumer of a stream queue while reconnecting was accepted (nil), then the configured queue was not consumed for 60 s")
		}
	}
	if addErr != nil && !errors.Is(addErr, ErrConfig) {
		t.Logf("refused with %v", addErr)
	}
}

// TestAddQueueQuorumUnderGlobalQos: add_consumer of a queue that exists as
// a quorum queue, while the consumer's channel runs under global QoS (its
// configured queues are classic), must consume it or refuse it without
// dropping the consuming connection: a delivery held meanwhile must still
// be acknowledged, and not come back.
func TestAddQueueQuorumUnderGlobalQos(t *testing.T) {
	cfg, q1, p, ctx := declaredQueue(t, "onceler_amqp_qqg", 60*time.Second)
	qq := testenv.Name("onceler_amqp_qqg")
	cleanupQueue(t, qq)
	conn, err := amqp091.Dial(cfg.URL)
	must(t, err, "dial")
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	must(t, err, "channel")
	_, err = ch.QueueDeclare(qq, true, false, false, false, amqp091.Table{"x-queue-type": "quorum"})
	must(t, err, "declare quorum queue")

	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQueue(q1)}, Prefetch: 4})
	got := make(chan *Delivery, 10)
	runConsumer(t, c, func(d *Delivery) { got <- d })
	testkit.WaitFor(t, "consumer ready", 10*time.Second, c.Ready)
	must(t, p.Publish(ctx, q1, q1, textMessage("held"), PublishOptions{Mandatory: true}), "publish")
	held := recv(t, got, 10*time.Second)

	addErr := c.AddQueue(CeleryQueue(qq))
	t.Logf("AddQueue(quorum queue) under global QoS = %v", addErr)
	heldSurvives(t, c, held, got, "add_consumer of a quorum queue")
	if addErr == nil {
		must(t, p.Publish(ctx, "", qq, textMessage("qq"), PublishOptions{Mandatory: true}), "publish qq")
		if d := recv(t, got, 10*time.Second); d.Queue != qq {
			t.Errorf("delivery from %s, want the added quorum queue", d.Queue)
		} else {
			must(t, d.Ack(), "ack")
		}
	}
}

// heldSurvives checks that the delivery held while what ran is still
// acknowledged on its channel: the consuming connection was not dropped,
// and the message does not come back.
func heldSurvives(t *testing.T, c *Consumer, held *Delivery, got <-chan *Delivery, what string) {
	t.Helper()
	if err := held.Ack(); err != nil {
		t.Errorf("the delivery held while %s ran can no longer be acknowledged: %v", what, err)
	}
	if n := c.reconnects.Load(); n != 0 {
		t.Errorf("%s dropped the consuming connection (%d reconnects)", what, n)
	}
	select {
	case d := <-got:
		t.Errorf("the message held while %s ran was redelivered: %q (redelivered=%v)", what, d.Body, d.Redelivered)
		_ = d.Ack()
	case <-time.After(2 * time.Second):
	}
}
