package tasks

import (
	"context"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceler/onceler/amqp"
)

// TestDeliveryLimitUnfailedReturnStillRuns: a quorum queue with
// x-delivery-limit 1. Its message was taken once by a consumer whose
// channel then closed without an ack (what RabbitMQ sees from a worker's
// graceful shutdown returning its prefetched messages, or from the node
// failover the URL lists are for): it never ran, never failed. RabbitMQ
// delivers it again (x-delivery-count 1, its last delivery), and that
// delivery would run and succeed. The worker must run it and answer
// SUCCESS; quarantining it as poison (WorkerLostError) loses a task that
// never failed.
func TestDeliveryLimitUnfailedReturnStillRuns(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	q := e.queue + "_lim1"
	args := amqp091.Table{"x-queue-type": "quorum", "x-delivery-limit": int32(1)}
	if _, err := e.ch.QueueDeclare(q, true, false, false, false, args); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = e.ch.QueueDelete(q, false, false, false)
		_, _ = e.ch.QueueDelete(quarantineName(q), false, false, false)
	})
	replyTo, replies := e.replyQueue()
	pub, err := encodeForTest(payMessage("t.pay", 1, "lim-1", replyTo))
	if err != nil {
		t.Fatal(err)
	}
	pub.ReplyTo = replyTo // encodeForTest leaves it out
	if err := e.ch.PublishWithContext(context.Background(), "", q, false, false, pub); err != nil {
		t.Fatal(err)
	}
	// A consumer takes it and goes away before running it.
	ch, err := e.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	var got bool
	for deadline := time.Now().Add(10 * time.Second); !got && time.Now().Before(deadline); {
		if _, got, err = ch.Get(q, false); err != nil {
			t.Fatal(err)
		}
		if !got {
			time.Sleep(20 * time.Millisecond)
		}
	}
	if !got {
		t.Fatal("message not delivered")
	}
	if err := ch.Close(); err != nil {
		t.Fatal(err)
	}

	fx := &effects{}
	cfg := e.config()
	cfg.Queues = []amqp.QueueSpec{{Name: q, Exchange: amqp.DefaultExchange, Durable: true, Quorum: true,
		Args: map[string]any{"x-delivery-limit": int32(1)}}}
	e.start(testRegistry(t, fx), cfg)
	res := results(t, replies, 1, 20*time.Second)
	if r := res[taskID(1)][0]; r["status"] != "SUCCESS" {
		t.Errorf("caller answered %v %v, want SUCCESS: a task that never failed was not run", r["status"], r["result"])
	}
	if n := fx.snapshot()["lim-1"]; n != 1 {
		t.Errorf("operation ran %d times, want 1", n)
	}
	takeQuarantined := func() []amqp091.Delivery {
		var out []amqp091.Delivery
		for {
			d, ok, err := e.ch.Get(quarantineName(q), true)
			if err != nil || !ok {
				return out
			}
			out = append(out, d)
		}
	}
	if qd := takeQuarantined(); len(qd) != 0 {
		t.Errorf("quarantined as %v: %v", qd[0].Headers[HeaderReason], qd[0].Headers[HeaderDetail])
	}
}
