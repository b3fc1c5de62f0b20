package amqp

import (
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// TestAddAndCancelQueue: a queue added while consuming is declared and
// consumed, listed by Queues, and consumed again after a reconnect; once
// cancelled, messages sent to it stay there.
func TestAddAndCancelQueue(t *testing.T) {
	cfg := testConfig(t)
	q1, q2 := testenv.Name("onceler_amqp_add"), testenv.Name("onceler_amqp_add")
	cleanupQueue(t, q1, q2)
	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQueue(q1)}})
	got := make(chan *Delivery, 10)
	runConsumer(t, c, func(d *Delivery) { got <- d })
	testkit.WaitFor(t, "consumer ready", 10*time.Second, c.Ready)
	must(t, c.AddQueue(CeleryQueue(q2)), "add queue")
	must(t, c.AddQueue(CeleryQueue(q2)), "add queue again")
	if qs := c.Queues(); len(qs) != 2 || qs[1].Name != q2 || !qs[1].Durable {
		t.Fatalf("Queues() = %+v", qs)
	}
	p := newPublisher(t, cfg)
	ctx := ctxTimeout(t, 30*time.Second)
	must(t, p.Publish(ctx, q2, q2, textMessage("2"), PublishOptions{Mandatory: true}), "publish q2")
	if d := recv(t, got, 10*time.Second); d.Queue != q2 || string(d.Body) != "2" {
		t.Fatalf("delivery from %s: %q", d.Queue, d.Body)
	} else {
		must(t, d.Ack(), "ack")
	}

	// after a reconnect, the added queue is consumed again
	if closeConnection(t, cfg.Name+" consume") != 1 {
		t.Fatal("no connection to close")
	}
	testkit.WaitFor(t, "consumer back", 20*time.Second, func() bool { return c.Ready() && c.reconnects.Load() > 0 })
	must(t, p.Publish(ctx, q2, q2, textMessage("3"), PublishOptions{Mandatory: true}), "publish q2")
	if d := recv(t, got, 10*time.Second); d.Queue != q2 || string(d.Body) != "3" {
		t.Fatalf("delivery from %s: %q", d.Queue, d.Body)
	} else {
		must(t, d.Ack(), "ack")
	}

	was, err := c.CancelQueue(q2)
	if !was || err != nil {
		t.Fatalf("CancelQueue = %v, %v", was, err)
	}
	if was, _ := c.CancelQueue(q2); was {
		t.Error("cancelled twice")
	}
	if qs := c.Queues(); len(qs) != 1 || qs[0].Name != q1 {
		t.Fatalf("Queues() after cancel = %+v", qs)
	}
	must(t, p.Publish(ctx, q2, q2, textMessage("4"), PublishOptions{Mandatory: true}), "publish q2")
	must(t, p.Publish(ctx, q1, q1, textMessage("1"), PublishOptions{Mandatory: true}), "publish q1")
	if d := recv(t, got, 10*time.Second); d.Queue != q1 {
		t.Fatalf("after cancel, a delivery from %s: %q", d.Queue, d.Body)
	} else {
		must(t, d.Ack(), "ack")
	}
	select {
	case d := <-got:
		t.Fatalf("after cancel, a delivery from %s: %q", d.Queue, d.Body)
	case <-time.After(500 * time.Millisecond):
	}
}

// TestAddedQueueRefusedOnReconnectIsDropped: a queue added at run time that
// the broker refuses on a reconnect (deleted and declared again as a stream
// queue meanwhile) is dropped; the consumer goes on with its configured
// queue instead of ending.
func TestAddedQueueRefusedOnReconnectIsDropped(t *testing.T) {
	cfg, q1, p, ctx := declaredQueue(t, "onceler_amqp_drop", 60*time.Second)
	q2 := testenv.Name("onceler_amqp_drop")
	cleanupQueue(t, q2)
	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQueue(q1)}})
	got := make(chan *Delivery, 10)
	runConsumer(t, c, func(d *Delivery) { got <- d })
	testkit.WaitFor(t, "consumer ready", 10*time.Second, c.Ready)
	must(t, c.AddQueue(CeleryQueue(q2)), "add queue")

	conn, err := amqp091.Dial(cfg.URL)
	must(t, err, "dial")
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	must(t, err, "channel")
	_, err = ch.QueueDelete(q2, false, false, false)
	must(t, err, "delete")
	_, err = ch.QueueDeclare(q2, true, false, false, false, amqp091.Table{"x-queue-type": "stream"})
	must(t, err, "declare stream queue")
	if closeConnection(t, cfg.Name+" consume") != 1 {
		t.Fatal("no connection to close")
	}
	testkit.WaitFor(t, "consumer back", 20*time.Second, func() bool { return c.Ready() && c.reconnects.Load() > 0 })
	if qs := c.Queues(); len(qs) != 1 || qs[0].Name != q1 {
		t.Errorf("Queues() after the added queue was refused = %+v", qs)
	}
	must(t, p.Publish(ctx, q1, q1, textMessage("1"), PublishOptions{Mandatory: true}), "publish q1")
	if d := recv(t, got, 10*time.Second); d.Queue != q1 {
		t.Errorf("delivery from %s", d.Queue)
	} else {
		must(t, d.Ack(), "ack")
	}
}
