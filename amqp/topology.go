package amqp

import (
	"fmt"

	amqp091 "github.com/onceler/onceler/internal/amqp091"
)

// QueueSpec describes a queue, the exchange it is bound to and the binding,
// declared the way kombu declares a kombu.Queue so that Celery producers and
// onceler agree on every flag and argument.
type QueueSpec struct {
	// Name is the queue name.
	Name string
	// Exchange is the exchange to bind to; empty means Name, as kombu
	// derives it. DefaultExchange ("amq.default") binds nothing: the broker's
	// default exchange routes by queue name.
	Exchange string
	// ExchangeType is the exchange kind; default "direct".
	ExchangeType string
	// RoutingKey is the binding key; default Name.
	RoutingKey string
	// Durable and AutoDelete are the queue's flags. The exchange is always
	// declared durable and not auto-delete, kombu's Exchange defaults.
	Durable, AutoDelete bool
	// Args are the queue arguments (x-max-priority, x-message-ttl, ...).
	Args map[string]any
	// Quorum declares a quorum queue (x-queue-type: quorum; durable, not
	// auto-delete) and makes the consumer's prefetch per consumer.
	Quorum bool
	// Passive only checks that the queue (and a named exchange) exist;
	// nothing is created or bound, and flags are not compared.
	Passive bool
}

// DefaultExchange names the broker's default exchange in QueueSpec.Exchange.
const DefaultExchange = "amq.default"

// CeleryQueue returns the spec Celery uses for a queue from task_queues or
// task_default_queue: a durable queue, a durable direct exchange of the same
// name and a binding with the queue name as key.
func CeleryQueue(name string) QueueSpec {
	return QueueSpec{Name: name, Exchange: name, ExchangeType: "direct", RoutingKey: name, Durable: true}
}

// CeleryQuorumQueue is CeleryQueue with x-queue-type quorum, as declared by
// kombu.Queue(name, ..., queue_arguments={"x-queue-type": "quorum"}).
func CeleryQuorumQueue(name string) QueueSpec {
	q := CeleryQueue(name)
	q.Quorum = true
	return q
}

// IsQuorum reports whether q is a quorum queue: Quorum, or x-queue-type
// quorum among its arguments.
func (q QueueSpec) IsQuorum() bool { return q.isQuorum() }

func (q QueueSpec) isQuorum() bool {
	t, _ := q.Args["x-queue-type"].(string)
	return q.Quorum || t == "quorum"
}

// resolved fills in kombu's defaults.
func (q QueueSpec) resolved() QueueSpec {
	if q.Exchange == "" {
		q.Exchange = q.Name
	}
	if q.Exchange == DefaultExchange {
		q.Exchange = ""
	}
	if q.ExchangeType == "" {
		q.ExchangeType = amqp091.ExchangeDirect
	}
	if q.RoutingKey == "" {
		q.RoutingKey = q.Name
	}
	if q.Quorum {
		q.Durable, q.AutoDelete = true, false
	}
	return q
}

// queueArgs returns the queue arguments to declare with.
func (q QueueSpec) queueArgs() (amqp091.Table, error) {
	n := len(q.Args)
	if q.Quorum {
		n++
	}
	if n == 0 {
		return nil, nil
	}
	args := make(map[string]any, n)
	for k, v := range q.Args {
		args[k] = v
	}
	if q.Quorum {
		args["x-queue-type"] = "quorum"
	}
	t, err := toTable(args)
	if err != nil {
		return nil, fmt.Errorf("%w: queue %q arguments: %w", ErrConfig, q.Name, err)
	}
	return t, nil
}

// declare declares q on ch. A failure closes ch (AMQP channel error).
func declare(ch *amqp091.Channel, spec QueueSpec) error {
	q := spec.resolved()
	if q.Name == "" {
		return fmt.Errorf("%w: queue spec without a name", ErrConfig)
	}
	args, err := q.queueArgs()
	if err != nil {
		return err
	}
	if q.Passive {
		if q.Exchange != "" {
			if err := ch.ExchangeDeclarePassive(q.Exchange, q.ExchangeType, true, false, false, false, nil); err != nil {
				return declareError(err, "exchange", q.Exchange, "passive")
			}
		}
		if _, err := ch.QueueDeclarePassive(q.Name, q.Durable, q.AutoDelete, false, false, args); err != nil {
			return declareError(err, "queue", q.Name, "passive")
		}
		return nil
	}
	if q.Exchange != "" {
		if err := ch.ExchangeDeclare(q.Exchange, q.ExchangeType, true, false, false, false, nil); err != nil {
			return declareError(err, "exchange", q.Exchange, "type="+q.ExchangeType+" "+describeDeclare(true, false, nil))
		}
	}
	if _, err := ch.QueueDeclare(q.Name, q.Durable, q.AutoDelete, false, false, args); err != nil {
		return declareError(err, "queue", q.Name, describeDeclare(q.Durable, q.AutoDelete, args))
	}
	if q.Exchange != "" {
		if err := ch.QueueBind(q.Name, q.RoutingKey, q.Exchange, false, nil); err != nil {
			return declareError(err, "binding of queue", q.Name, "exchange="+q.Exchange+" key="+q.RoutingKey)
		}
	}
	return nil
}
