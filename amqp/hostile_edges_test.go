package amqp

import (
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceler/onceler/internal/testenv"
)

// TestExchangeDeclaredMomentLaterNotPermanent: an exchange that is
// missing for a moment (a non-durable exchange after a broker restart,
// until its owner declares it again; an application that declares its
// exchange when it starts, after the worker) is a state of the broker, not
// a refusal of what the publish asks: the publish is looked at again, and
// succeeds once the exchange is there 300 ms later.
func TestExchangeDeclaredMomentLaterNotPermanent(t *testing.T) {
	_, q, p, ctx := declaredQueue(t, "onceler_amqp_lateex", 20*time.Second)
	ex := testenv.Name("onceler_amqp_lateex_x")
	conn, err := amqp091.Dial(testenv.AMQPURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ch.ExchangeDelete(ex, false, false) })
	declared := make(chan error, 1)
	go func() {
		time.Sleep(300 * time.Millisecond)
		if err := ch.ExchangeDeclare(ex, "direct", false, false, false, false, nil); err != nil {
			declared <- err
			return
		}
		declared <- ch.QueueBind(q, "k", ex, false, nil)
	}()
	start := time.Now()
	err = p.Publish(ctx, ex, "k", textMessage("x"), PublishOptions{Mandatory: true})
	took := time.Since(start)
	if derr := <-declared; derr != nil {
		t.Fatal(derr)
	}
	if IsPermanent(err) {
		t.Fatalf("publish to an exchange declared 300 ms later: permanent after %s: %v", took.Round(time.Millisecond), err)
	}
	if err != nil {
		t.Logf("publish failed (not permanent): %v", err)
	}
}
