package amqp

import (
	"context"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// declareRaw declares queue q as an application would, on a connection of
// its own.
func declareRaw(t *testing.T, q string, args amqp091.Table) {
	t.Helper()
	conn, err := amqp091.Dial(testenv.AMQPURL(t))
	must(t, err, "dial")
	defer conn.Close()
	ch, err := conn.Channel()
	must(t, err, "channel")
	_, err = ch.QueueDeclare(q, true, false, false, false, args)
	must(t, err, "declare %s", q)
}

// TestEdgeQuorumQueueWithLongAnswerConsumed: RabbitMQ cuts its 406 text at
// 255 bytes (an AMQP short string), so for a quorum queue whose
// dead-letter exchange name or own name is long, the answer naming
// x-dead-letter-exchange (compared before x-queue-type) or x-queue-type
// cannot be read. The queue must still be consumed as the quorum queue it
// is: a channel with global QoS cannot consume a quorum queue (540
// NOT_IMPLEMENTED closes the connection).
func TestEdgeQuorumQueueWithLongAnswerConsumed(t *testing.T) {
	for _, tc := range []struct {
		name string
		q    string
		args amqp091.Table
	}{
		{"long dead-letter exchange", testenv.Name("onceler_amqp_qqdlx"),
			amqp091.Table{"x-queue-type": "quorum", "x-dead-letter-exchange": "dead." + strings.Repeat("d", 200)}},
		{"long queue name", testenv.Name("onceler_amqp_qqname_" + strings.Repeat("n", 120)),
			amqp091.Table{"x-queue-type": "quorum"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig(t)
			cleanupQueue(t, tc.q)
			declareRaw(t, tc.q, tc.args)
			c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQueue(tc.q)}, Prefetch: 2})
			got := make(chan *Delivery, 4)
			runConsumer(t, c, func(d *Delivery) { got <- d })
			p := newPublisher(t, cfg)
			ctx := ctxTimeout(t, 30*time.Second)
			must(t, p.Publish(ctx, "", tc.q, textMessage(`"x"`), PublishOptions{Mandatory: true}), "publish")
			select {
			case d := <-got:
				must(t, d.Ack(), "ack")
			case <-time.After(10 * time.Second):
				t.Fatalf("no delivery within 10s from quorum queue %s; found as %+v (quorum %t), reconnects %d",
					tc.q, c.Queues()[0].Args, c.Queues()[0].IsQuorum(), c.reconnects.Load())
			}
			// Its type cannot be read from the cut answer; what matters is
			// that it is consumed, with a per-consumer prefetch.
		})
	}
}

// TestEdgeConfiguredArgsNotShownAsTheQueues: arguments configured for a
// missing queue (QueueSpec.Args, --queue-arg) that RabbitMQ does not
// compare for the existing queue's type are accepted by the learning
// declare and then reported as the queue's own: an existing quorum queue
// configured with x-max-priority is reported as a priority queue
// (MaxPriority 10, which makes the worker's prefetch default to the
// concurrency), and a classic queue with x-delivery-limit or a custom
// argument it does not have.
func TestEdgeConfiguredArgsNotShownAsTheQueues(t *testing.T) {
	cfg := testConfig(t)
	quorum, classic := testenv.Name("onceler_amqp_qqprio"), testenv.Name("onceler_amqp_clcustom")
	cleanupQueue(t, quorum, classic)
	declareRaw(t, quorum, amqp091.Table{"x-queue-type": "quorum"})
	declareRaw(t, classic, nil)
	p := newPublisher(t, cfg)
	ctx := ctxTimeout(t, 30*time.Second)

	spec := CeleryQueue(quorum)
	spec.Args = map[string]any{"x-max-priority": int64(10)}
	found, err := p.DeclareQueue(ctx, spec)
	must(t, err, "declare existing quorum queue")
	if found.MaxPriority() != 0 || found.Args["x-max-priority"] != nil {
		t.Errorf("quorum queue declared without x-max-priority found as %+v: MaxPriority %d", found.Args, found.MaxPriority())
	}

	spec = CeleryQueue(classic)
	spec.Args = map[string]any{"x-delivery-limit": int64(5), "x-app-owner": "billing"}
	found, err = p.DeclareQueue(ctx, spec)
	must(t, err, "declare existing classic queue")
	if len(found.Args) != 0 {
		t.Errorf("classic queue declared without arguments found as %+v", found.Args)
	}

	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{func() QueueSpec {
		q := CeleryQueue(quorum)
		q.Args = map[string]any{"x-max-priority": int64(10)}
		return q
	}()}, Prefetch: 2})
	runConsumer(t, c, func(d *Delivery) { _ = d.Ack() })
	testkit.WaitFor(t, "consumer ready", 15*time.Second, c.Ready)
	if q := c.Queues()[0]; q.MaxPriority() != 0 {
		t.Errorf("Consumer.Queues reports quorum queue %s with x-max-priority: %+v", quorum, q.Args)
	}
}

// TestEdgeStreamQueueNotALoop: a stream queue (x-queue-type stream, which
// the learning finds) cannot be consumed under global QoS (406 "consumer
// prefetch count is not set"). The consumer must either consume it (with
// a per-consumer prefetch) or give up with a topology error; it must not
// reconnect forever, declaring and failing at every attempt.
func TestEdgeStreamQueueNotALoop(t *testing.T) {
	cfg := testConfig(t)
	q := testenv.Name("onceler_amqp_stream")
	cleanupQueue(t, q)
	declareRaw(t, q, amqp091.Table{"x-queue-type": "stream"})
	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQueue(q)}, Prefetch: 2})
	got := make(chan *Delivery, 4)
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx, func(d *Delivery) { got <- d }) }()
	p := newPublisher(t, cfg)
	pctx := ctxTimeout(t, 30*time.Second)
	for {
		must(t, p.Publish(pctx, "", q, textMessage(`"s"`), PublishOptions{Mandatory: true}), "publish")
		select {
		case d := <-got:
			must(t, d.Ack(), "ack")
			cancel()
			<-done
			return
		case err := <-done:
			if err == nil || !IsTopologyError(err) {
				t.Fatalf("stream queue %s found as %+v: no delivery and no topology error in 8s (Run = %v), %d reconnects",
					q, c.Queues()[0].Args, err, c.reconnects.Load())
			}
			return
		case <-time.After(500 * time.Millisecond):
		}
	}
}
