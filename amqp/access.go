package amqp

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"

	"go.uber.org/zap"

	amqp091 "github.com/onceler/onceler/internal/amqp091"
)

// AccessError is RabbitMQ's 403 ACCESS_REFUSED for an operation on a
// queue or exchange: the user lacks the configure, write or read permission
// on that resource in the vhost (rabbitmqctl set_permissions). Declaring
// (and deleting) takes configure on the queue or exchange; binding takes
// write on the queue and read on the exchange; publishing takes write on
// the exchange (the default exchange is amq.default); consuming and
// getting take read on the queue. Declaring a queue with a dead-letter
// exchange (x-dead-letter-exchange) takes write on that exchange too. A
// topic permission (rabbitmqctl set_topic_permissions) limits the routing
// keys the user may publish with to a topic exchange: its refusal names
// the exchange and the routing key (Topic). errors.Is(err,
// ErrAccessRefused) is true for it.
type AccessError struct {
	// Op is what was being done: "declare queue", "declare exchange",
	// "bind queue", "publish", "consume", "get".
	Op string
	// Permission is the one refused: "configure", "write" or "read".
	Permission string
	// Kind ("queue" or "exchange"), Name, VHost and User are the resource
	// and the user as the broker's answer names them (empty when it does
	// not).
	Kind, Name, VHost, User string
	// Topic is the routing key refused by a topic permission (Kind is
	// then "exchange"), else empty.
	Topic string
	// For says what the worker needed the operation for, when the caller
	// set it, e.g. "remote control".
	For string
	// Reason is the broker's reply text.
	Reason string
}

func (e *AccessError) Error() string {
	op := e.Op
	if e.For != "" {
		op += ", for " + e.For
	}
	if e.Kind == "" {
		return fmt.Sprintf("RabbitMQ refused %s permission (%s): %s", e.Permission, op, e.Reason)
	}
	if e.Topic != "" {
		return fmt.Sprintf("RabbitMQ refused user %q %s access to %s '%s' in vhost '%s' for routing key '%s' (%s): %s",
			e.User, e.Permission, e.Kind, e.Name, e.VHost, e.Topic, op, e.Reason)
	}
	return fmt.Sprintf("RabbitMQ refused user %q %s access to %s '%s' in vhost '%s' (%s): %s",
		e.User, e.Permission, e.Kind, e.Name, e.VHost, op, e.Reason)
}

// AccessFor sets the For of the *AccessError in err, if any, to what, and
// returns err.
func AccessFor(err error, what string) error {
	var ae *AccessError
	if errors.As(err, &ae) && ae.For == "" {
		ae.For = what
	}
	return err
}

// Is makes errors.Is(err, ErrAccessRefused) true.
func (e *AccessError) Is(target error) bool { return target == ErrAccessRefused }

// refusedAccess matches RabbitMQ's 403 text for a resource, e.g.
// "ACCESS_REFUSED - access to queue 'q' in vhost 'v' refused for user 'u'".
var refusedAccess = regexp.MustCompile(`access to (queue|exchange) '(.*)' in vhost '(.*)' refused for user '(.*)'`)

// refusedTopic matches RabbitMQ's 403 text for a topic permission, e.g.
// "ACCESS_REFUSED - access to topic 'k' in exchange 'x' in vhost 'v'
// refused for user 'u'".
var refusedTopic = regexp.MustCompile(`access to topic '(.*)' in exchange '(.*)' in vhost '(.*)' refused for user '(.*)'`)

// AccessRefusal returns err as an *AccessError when it is the broker's 403
// answer to op ("declare queue", "declare exchange", "bind queue",
// "publish", "consume", "get"), else nil.
func AccessRefusal(op string, err error) *AccessError {
	var ae *AccessError
	if errors.As(err, &ae) {
		return ae
	}
	be := brokerError(err)
	if be == nil || be.Code != amqp091.AccessRefused {
		return nil
	}
	e := &AccessError{Op: op, Reason: be.Reason}
	if m := refusedTopic.FindStringSubmatch(be.Reason); m != nil {
		e.Kind, e.Topic, e.Name, e.VHost, e.User = "exchange", m[1], m[2], m[3], m[4]
	} else if m := refusedAccess.FindStringSubmatch(be.Reason); m != nil {
		e.Kind, e.Name, e.VHost, e.User = m[1], m[2], m[3], m[4]
	}
	switch {
	case op == "declare queue" && e.Kind == "exchange":
		// a queue's declare names an exchange only for its dead-letter
		// exchange, on which it checks write
		e.Permission = "write"
	case strings.HasPrefix(op, "declare"), strings.HasPrefix(op, "delete"):
		e.Permission = "configure"
	case strings.HasPrefix(op, "bind"):
		// write on the queue, read on the exchange: the answer names
		// the one refused
		e.Permission = "write"
		if e.Kind == "exchange" {
			e.Permission = "read"
		}
	case op == "publish":
		e.Permission = "write"
	default: // consume, get
		e.Permission = "read"
	}
	return e
}

// accessCheckTimeout bounds waiting for the broker's answer to a write
// check.
const accessCheckTimeout = 10 * time.Second

// CheckWriteOn checks, on ch, that the user may publish to exchange (""
// is the default exchange) with routingKey, without sending a message: a
// routing key the worker publishes with there, so that a topic permission
// that lets the worker's messages through lets the check through. It
// publishes one
// with an invalid expiration, which RabbitMQ checks after the write
// permission and refuses (406) before routing, and reads the answer, which
// closes ch. A refused permission is an *AccessError; a missing exchange
// wraps ErrNotFound. The caller gives a channel of its own.
func CheckWriteOn(ctx context.Context, ch *amqp091.Channel, exchange, routingKey string) error {
	closed := ch.NotifyClose(make(chan *amqp091.Error, 1))
	err := ch.PublishWithContext(ctx, exchange, routingKey, false, false,
		amqp091.Publishing{Expiration: "-1", Body: []byte{}})
	if err == nil {
		// A synchronous method after the publish: its answer comes after
		// the broker's verdict on the publish, which closes the channel;
		// the reason comes on closed (the method itself may fail only with
		// "channel not open").
		qerr := ch.Qos(0, 0, false)
		t := time.NewTimer(accessCheckTimeout)
		defer t.Stop()
		select {
		case e := <-closed:
			err = qerr
			if e != nil {
				err = e
			}
		case <-t.C:
			err = qerr
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if err == nil {
		return nil // nothing refused: the broker took the expiration
	}
	if ae := AccessRefusal("publish", err); ae != nil {
		if ae.Kind == "" {
			ae.Kind, ae.Name = "exchange", exchangeName(exchange)
		}
		return ae
	}
	be := brokerError(err)
	switch {
	case be != nil && be.Code == amqp091.PreconditionFailed:
		return nil // past the permission check: "invalid expiration"
	case be != nil && be.Code == amqp091.NotFound:
		return fmt.Errorf("check publishing to exchange %s: %w: %s", exchangeName(exchange), ErrNotFound, be.Reason)
	}
	return fmt.Errorf("check publishing to exchange %s: %w", exchangeName(exchange), err)
}

// exchangeName is the name RabbitMQ gives exchange in its answers.
func exchangeName(exchange string) string {
	if exchange == "" {
		return DefaultExchange
	}
	return exchange
}

// CheckWrite checks that the user may publish to exchange ("" or
// DefaultExchange is the broker's default exchange) with routingKey,
// without sending a message (see CheckWriteOn), on a channel of its own.
func (p *Publisher) CheckWrite(ctx context.Context, exchange, routingKey string) error {
	if exchange == DefaultExchange {
		exchange = ""
	}
	// The check publishes: while the broker blocks publishing (a resource
	// alarm) it reads nothing more from the connection, and the check
	// would wait for the alarm to end. It is left out then (a refusal
	// still shows at the first publish), rather than keep the worker from
	// consuming for as long as the alarm lasts.
	done := make(chan error, 1)
	go func() {
		done <- p.withChannel(ctx, func(ch *amqp091.Channel) error {
			if p.blocked() {
				return errCheckBlocked
			}
			return CheckWriteOn(ctx, ch, exchange, routingKey)
		})
	}()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case err := <-done:
			if errors.Is(err, errCheckBlocked) {
				p.log.Warn("publish permission not checked: the broker blocks publishing (a resource alarm)", zap.String("exchange", exchangeName(exchange)))
				return nil
			}
			return err
		case <-tick.C:
			if p.blocked() {
				// The check's goroutine ends when the alarm does (or the
				// connection closes).
				p.log.Warn("publish permission not checked: the broker blocks publishing (a resource alarm)", zap.String("exchange", exchangeName(exchange)))
				return nil
			}
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// errCheckBlocked: CheckWrite found the broker blocking publishing.
var errCheckBlocked = errors.New("amqp: publishing blocked by the broker")
