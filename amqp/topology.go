package amqp

import (
	"errors"
	"fmt"
	"maps"
	"math"

	amqp091 "github.com/onceler/onceler/internal/amqp091"
	"github.com/onceler/onceler/internal/intval"
)

// QueueSpec describes a queue, the exchange it is bound to and the binding,
// declared the way kombu declares a kombu.Queue so that Celery producers and
// onceler agree on every flag and argument.
//
// A queue that exists is served as it is: its flags and arguments are the
// business of whoever declared it (typically the Celery application's
// task_queues), and Durable, AutoDelete, Args and Quorum apply only to a
// queue that is missing and gets declared here. See "Queues" in the package
// documentation.
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
	// Durable and AutoDelete are the flags of a queue declared here. The
	// exchange, when declared here, is durable and not auto-delete, kombu's
	// Exchange defaults.
	Durable, AutoDelete bool
	// Args are the arguments a missing queue is declared with
	// (x-max-priority, x-message-ttl, x-dead-letter-exchange, ...). In a
	// spec returned by Consumer.Queues or Publisher.DeclareQueue, they are
	// the queue's arguments as the broker holds them.
	Args map[string]any
	// Quorum declares a missing queue as a quorum queue (x-queue-type:
	// quorum; durable, not auto-delete).
	Quorum bool
	// Passive only checks that the queue (and a named exchange) exist;
	// nothing is created or bound, and its arguments are not learned: a
	// passive spec says itself (Quorum, or x-queue-type in Args) whether the
	// queue is a quorum queue.
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

// MaxPriority returns the queue's x-max-priority argument, 0 when it has
// none: a priority queue hands out its ready messages highest priority
// first.
func (q QueueSpec) MaxPriority() int {
	n, _ := intval.Whole(q.Args["x-max-priority"])
	return int(n)
}

// DeliveryLimit returns the x-delivery-limit argument of a quorum queue
// (the broker drops or dead-letters a message returned more often), 0
// when it has none or is no quorum queue. A limit set by a policy
// (delivery-limit) is not among a queue's arguments: it is not seen here.
//
// The argument may be any integer type or a whole double (RabbitMQ
// enforces 1.0 as 1). A limit of 0 is returned as 0 too: such a queue is
// refused (ErrConfig) when declared or found.
func (q QueueSpec) DeliveryLimit() int {
	n, _ := q.deliveryLimit()
	return n
}

// deliveryLimit returns the delivery limit of a quorum queue and whether
// it has one (a negative or unreadable x-delivery-limit is none).
func (q QueueSpec) deliveryLimit() (int, bool) {
	if !q.isQuorum() {
		return 0, false
	}
	n, ok := intval.Whole(q.Args["x-delivery-limit"])
	if !ok || n < 0 {
		return 0, false
	}
	return int(min(n, math.MaxInt32)), true
}

// checkDeliveryLimit refuses a quorum queue whose x-delivery-limit is 0:
// every delivery is the broker's last, so a message whose worker dies
// while running it is dropped, and the worker could neither run it under
// protection nor keep it (the delivery limit handling republishes a
// message on its last delivery: with limit 0 it would republish forever).
func checkDeliveryLimit(q QueueSpec) error {
	if n, ok := q.deliveryLimit(); ok && n == 0 {
		return fmt.Errorf("%w: queue %s: x-delivery-limit 0 drops any message whose worker dies; raise it", ErrConfig, q.Name)
	}
	return nil
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

// declaredArgs returns the arguments to declare a missing queue with: Args,
// and x-queue-type quorum for Quorum.
func (q QueueSpec) declaredArgs() map[string]any {
	if len(q.Args) == 0 && !q.Quorum {
		return nil
	}
	args := make(map[string]any, len(q.Args)+1)
	maps.Copy(args, q.Args)
	if q.Quorum {
		args["x-queue-type"] = "quorum"
	}
	return args
}

// queueArgs returns the queue arguments to declare with, as a table.
func (q QueueSpec) queueArgs() (amqp091.Table, error) {
	t, err := toTable(q.declaredArgs())
	if err != nil {
		return nil, fmt.Errorf("%w: queue %q arguments: %w", ErrConfig, q.Name, err)
	}
	return t, nil
}

// queueState is a queue as ensure found or made it.
type queueState struct {
	// spec is the queue as found: for a queue that existed, its flags and
	// arguments as the broker holds them (when learned).
	spec QueueSpec
	// created: the queue was missing and was declared with the spec's
	// flags and arguments.
	created bool
	// learned: spec's flags and arguments are the broker's (false for a
	// passive spec, or when the broker would not tell: then they are the
	// configured ones).
	learned bool
	// differs: the queue existed with other flags or arguments than the
	// configuration would have declared it with.
	differs bool
	// unlearned says why the arguments could not be learned.
	unlearned error
}

// scratch is a channel for declares that may be refused: a refusal (404,
// 406) closes the channel, so a new one is opened for the next call.
type scratch struct {
	conn interface {
		Channel() (*amqp091.Channel, error)
	}
	ch *amqp091.Channel
}

func (s *scratch) get() (*amqp091.Channel, error) {
	if s.ch != nil && !s.ch.IsClosed() {
		return s.ch, nil
	}
	ch, err := s.conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("open channel: %w", err)
	}
	s.ch = ch
	return ch, nil
}

// do runs fn on the scratch channel; after an error the channel is given
// up (a broker refusal has closed it).
func (s *scratch) do(fn func(ch *amqp091.Channel) error) error {
	ch, err := s.get()
	if err != nil {
		return err
	}
	if err := fn(ch); err != nil {
		s.close()
		return err
	}
	return nil
}

func (s *scratch) close() {
	if s.ch != nil {
		_ = s.ch.Close()
		s.ch = nil
	}
}

// ensure makes sure the queue of spec exists and is bound as Celery binds
// it, and returns it as found. An existing queue is checked passively and
// served with whatever flags and arguments it has, which are learned from
// the broker; prev, when not nil, is the queue as found before (on the
// last connect), whose flags and arguments are tried first. A missing queue
// is declared with the spec's. The exchange is declared only when missing;
// the binding, a no-op when it exists, is made either way. A passive spec
// is only checked.
func ensure(sc *scratch, spec QueueSpec, prev *QueueSpec) (queueState, error) {
	q := spec.resolved()
	if q.Name == "" {
		return queueState{}, fmt.Errorf("%w: queue spec without a name", ErrConfig)
	}
	args, err := q.queueArgs()
	if err != nil {
		return queueState{}, err
	}
	if err := checkDeliveryLimit(q); err != nil {
		return queueState{}, err
	}
	if q.Passive {
		return queueState{spec: unresolved(q)}, checkPassive(sc, q)
	}
	if q.Exchange != "" {
		if err := ensureExchange(sc, q); err != nil {
			return queueState{}, err
		}
	}
	var st queueState
	for attempt := 0; ; attempt++ {
		exists, err := queueExists(sc, q.Name)
		if err != nil {
			return queueState{}, err
		}
		if exists {
			// Learn from no arguments at all: RabbitMQ accepts a declare
			// carrying arguments it does not compare for the queue's type
			// (x-max-priority on a quorum queue), so starting from the
			// configured ones would report those as the queue's.
			from := q
			from.Args, from.Quorum = nil, false
			if prev != nil {
				from.Durable, from.AutoDelete, from.Args = prev.Durable, prev.AutoDelete, prev.Args
			}
			if st, err = learn(sc, q, from); err != nil {
				return queueState{}, err
			}
			if t, _ := st.spec.Args["x-queue-type"].(string); t == "stream" {
				return queueState{}, fmt.Errorf("%w: queue %s is a stream queue, which keeps its messages for every reader: a Celery worker consumes classic and quorum queues", ErrConfig, q.Name)
			}
			if err := checkDeliveryLimit(st.spec); err != nil {
				return queueState{}, err
			}
			break
		}
		err = sc.do(func(ch *amqp091.Channel) error {
			_, err := ch.QueueDeclare(q.Name, q.Durable, q.AutoDelete, false, false, args)
			return err
		})
		if err == nil {
			found := q
			found.Args, found.Quorum = q.declaredArgs(), false
			st = queueState{spec: found, created: true, learned: true}
			break
		}
		err = declareError(err, "queue", q.Name, describeDeclare(q.Durable, q.AutoDelete, args))
		var pe *PreconditionError
		if errors.As(err, &pe) && pe.Arg != "" && attempt < 2 {
			continue // declared meanwhile by someone else, otherwise: serve it as it is
		}
		return queueState{}, err
	}
	if q.Exchange != "" {
		err := sc.do(func(ch *amqp091.Channel) error { return ch.QueueBind(q.Name, q.RoutingKey, q.Exchange, false, nil) })
		if err != nil {
			return queueState{}, declareError(err, "binding of queue", q.Name, "exchange="+q.Exchange+" key="+q.RoutingKey)
		}
	}
	st.spec = unresolved(st.spec)
	return st, nil
}

// unresolved spells a resolved spec's default exchange as DefaultExchange
// again, so that resolving it once more keeps it.
func unresolved(q QueueSpec) QueueSpec {
	if q.Exchange == "" {
		q.Exchange = DefaultExchange
	}
	return q
}

// queueExists checks q passively: a missing queue is (false, nil).
func queueExists(sc *scratch, name string) (bool, error) {
	err := sc.do(func(ch *amqp091.Channel) error {
		_, err := ch.QueueDeclarePassive(name, false, false, false, false, nil)
		return err
	})
	if ae := brokerError(err); ae != nil && ae.Code == amqp091.NotFound {
		return false, nil
	}
	if err != nil {
		return false, declareError(err, "queue", name, "passive")
	}
	return true, nil
}

// ensureExchange declares q's exchange, as kombu does, when it is missing;
// one that exists is left as it is, whatever its type.
func ensureExchange(sc *scratch, q QueueSpec) error {
	for attempt := 0; ; attempt++ {
		err := sc.do(func(ch *amqp091.Channel) error {
			return ch.ExchangeDeclarePassive(q.Exchange, q.ExchangeType, true, false, false, false, nil)
		})
		if err == nil {
			return nil
		}
		if ae := brokerError(err); ae == nil || ae.Code != amqp091.NotFound {
			return declareError(err, "exchange", q.Exchange, "passive")
		}
		err = sc.do(func(ch *amqp091.Channel) error {
			return ch.ExchangeDeclare(q.Exchange, q.ExchangeType, true, false, false, false, nil)
		})
		if err == nil {
			return nil
		}
		err = declareError(err, "exchange", q.Exchange, "type="+q.ExchangeType+" "+describeDeclare(true, false, nil))
		if !errors.Is(err, ErrPrecondition) || attempt >= 2 {
			return err
		}
		// Declared meanwhile by someone else, otherwise: use it.
	}
}

// checkPassive checks that q (and its named exchange) exist.
func checkPassive(sc *scratch, q QueueSpec) error {
	if q.Exchange != "" {
		err := sc.do(func(ch *amqp091.Channel) error {
			return ch.ExchangeDeclarePassive(q.Exchange, q.ExchangeType, true, false, false, false, nil)
		})
		if err != nil {
			return declareError(err, "exchange", q.Exchange, "passive")
		}
	}
	err := sc.do(func(ch *amqp091.Channel) error {
		_, err := ch.QueueDeclarePassive(q.Name, q.Durable, q.AutoDelete, false, false, nil)
		return err
	})
	if err != nil {
		return declareError(err, "queue", q.Name, "passive")
	}
	return nil
}
