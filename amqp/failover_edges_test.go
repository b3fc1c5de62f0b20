package amqp

import (
	"context"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceler/onceler/internal/testenv"
)

// TestEdgeSemicolonPasswordNotInErrors: a password holding a literal ';'
// (RFC 3986 allows it in userinfo) is cut by the failover-list split. The
// ErrConfig that endpoints (consumer, publisher, TLSClientConfig) and
// DialURLs (the remote control) return must not hold any part of the
// password; Go's url parser quotes the part before the ';' as an
// "invalid port" (as it does the part before an unencoded '/').
func TestEdgeSemicolonPasswordNotInErrors(t *testing.T) {
	t.Parallel()
	const secret = "Sup3rSecret"
	for _, u := range []string{
		"amqp://app:" + secret + ";tail@rabbit1:5672//",
		"amqp://app:" + secret + ";tail@rabbit1//;amqp://app:" + secret + ";tail@rabbit2//",
		"pyamqp://app:" + secret + ";@rabbit1//",
		// Not the split, the same quote: an unencoded '/' in a password.
		"amqp://app:" + secret + "/x@rabbit1//;amqp://app:pw@rabbit2//",
	} {
		_, err := Config{URL: u}.endpoints()
		if err == nil || strings.Contains(err.Error(), secret) {
			t.Errorf("endpoints(%s): %v", RedactURL(u), err)
		}
		_, err = Config{URLs: []string{u}}.TLSClientConfig()
		if err == nil || strings.Contains(err.Error(), secret) {
			t.Errorf("TLSClientConfig(URLs %s): %v", RedactURL(u), err)
		}
		_, err = DialURLs(u)
		if err == nil || strings.Contains(err.Error(), secret) {
			t.Errorf("DialURLs(%s): %v", RedactURL(u), err)
		}
	}
}

// TestEdgeDeliveryLimitAsDouble: RabbitMQ (3.10) enforces an
// x-delivery-limit given as a double (1.0 from a JSON-decoded
// configuration, a Python float in kombu's queue_arguments): the message
// is gone after its second delivery. The worker must see that limit
// (QueueSpec.DeliveryLimit, of the queue as found by DeclareQueue, as the
// consumer learns it, and of a configured spec); it reads 0 ("none"), so
// the broker's last delivery is run unprotected and dropped unanswered
// should it fail.
func TestEdgeDeliveryLimitAsDouble(t *testing.T) {
	t.Parallel()
	q := testenv.Name("onceler_amqp_limdouble")
	declareRaw(t, q, amqp091.Table{"x-queue-type": "quorum", "x-delivery-limit": float64(1)})
	conn, err := amqp091.Dial(testenv.AMQPURL(t))
	must(t, err, "dial")
	defer conn.Close()
	ch, err := conn.Channel()
	must(t, err, "channel")
	defer func() { _, _ = ch.QueueDelete(q, false, false, false) }()

	p := NewPublisher(Config{URL: testenv.AMQPURL(t)})
	defer func() { _ = p.Close() }()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	found, err := p.DeclareQueue(ctx, QueueSpec{Name: q, Exchange: DefaultExchange, Durable: true, Quorum: true})
	must(t, err, "declare %s", q)

	// The broker's own reading: two deliveries, then the message is dropped.
	must(t, ch.PublishWithContext(ctx, "", q, false, false, amqp091.Publishing{Body: []byte("x")}), "publish")
	deliveries := 0
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); {
		d, ok, err := ch.Get(q, false)
		must(t, err, "get")
		if !ok {
			time.Sleep(50 * time.Millisecond)
			if deliveries > 0 {
				break
			}
			continue
		}
		deliveries++
		must(t, d.Nack(false, true), "nack")
		time.Sleep(100 * time.Millisecond)
	}
	if deliveries != 2 {
		t.Fatalf("the broker delivered the message %d times with x-delivery-limit 1.0, expected 2 (limit enforced)", deliveries)
	}
	if got := found.DeliveryLimit(); got != 1 {
		t.Errorf("DeliveryLimit of the queue as found (args %v) = %d, want 1: RabbitMQ enforces the double", found.Args, got)
	}
	if got := (QueueSpec{Quorum: true, Args: map[string]any{"x-delivery-limit": float64(1)}}).DeliveryLimit(); got != 1 {
		t.Errorf("DeliveryLimit of a configured 1.0 = %d, want 1", got)
	}
}
