package amqp_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
)

// A consumer of Celery's default queue hands deliveries to a pool; the pool
// acknowledges each one after its work is recorded. After a reconnect, Ack
// of an older delivery reports ErrStaleDelivery: the broker redelivers it.
func ExampleConsumer() {
	cfg := amqp.Config{URL: "amqp://guest:guest@localhost:5672//", Name: "worker-1"}
	c := amqp.NewConsumer(cfg, amqp.ConsumerConfig{
		Queues:       []amqp.QueueSpec{amqp.CeleryQueue("celery")},
		Prefetch:     16,
		DrainTimeout: 30 * time.Second,
	})
	work := make(chan *amqp.Delivery, 16)
	go func() {
		for d := range work {
			// ... run the task, record the outcome ...
			if err := d.Ack(); errors.Is(err, amqp.ErrStaleDelivery) {
				log.Printf("channel gone; task %s will be redelivered", d.CorrelationID)
			}
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if err := c.Run(ctx, func(d *amqp.Delivery) { work <- d }); err != nil {
		log.Print(err) // e.g. a *PreconditionError: the broker refuses a missing queue's arguments
	}
	close(work)
}

// A result goes to the caller's reply queue with a confirm; a quarantined
// message must reach a queue, so it is published mandatory.
func ExamplePublisher_Publish() {
	p := amqp.NewPublisher(amqp.Config{URL: "amqp://guest:guest@localhost:5672//", Name: "worker-1"})
	defer p.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	msg := &celeryproto.Publishing{ContentType: "application/json", ContentEncoding: "utf-8", Body: []byte(`{}`), DeliveryMode: 2}
	err := p.Publish(ctx, "", "celery.quarantine", msg, amqp.PublishOptions{Mandatory: true})
	switch {
	case errors.Is(err, amqp.ErrReturned):
		log.Print("no quarantine queue: declare it first")
	case errors.Is(err, amqp.ErrUnconfirmed):
		log.Print("outcome unknown: publish again (duplicates are harmless here)")
	case err != nil:
		log.Print(err)
	}
}

// Listing a quarantine queue without consuming it, dropping one message.
func ExamplePublisher_Inspect() {
	p := amqp.NewPublisher(amqp.Config{URL: "amqp://guest:guest@localhost:5672//"})
	defer p.Close()
	ctx := context.Background()
	n, err := p.Inspect(ctx, "celery.quarantine", 100, func(d *amqp.Delivery) (amqp.InspectAction, error) {
		fmt.Println(d.CorrelationID, d.Headers["task"])
		if d.CorrelationID == "0b9c-bad" {
			return amqp.Remove, nil
		}
		return amqp.Keep, nil
	})
	log.Print(n, err)
}

func ExampleRedactURL() {
	fmt.Println(amqp.RedactURL("amqps://svc:hunter2@broker.internal:5671/prod"))
	// Output: amqps://svc:xxxxx@broker.internal:5671/prod
}
