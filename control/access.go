package control

import (
	"context"
	"fmt"

	"go.uber.org/zap"

	amqp091 "github.com/onceler/onceler/internal/amqp091"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
)

// CheckAccess does, once, what Run does on every connection that the
// broker may refuse for lack of a permission, so that a user without one
// is told at start rather than in Run's reconnect loop: it declares the
// exchanges celeryev, celery.pidbox and reply.celery.pidbox and the node's
// mailbox queue (configure), binds the queue (write on it, read on
// celery.pidbox), gets from it (read; a message got is given back), and
// checks publishing to celeryev and reply.celery.pidbox without sending
// a message (write; on celeryev with the heartbeat's routing key,
// worker.heartbeat). A refusal is an *amqp.AccessError; any other failure
// (the broker unreachable) is returned as it is, for Run to retry.
func (c *Controller) CheckAccess(ctx context.Context) error {
	conn, err := c.dial(ctx)
	if err != nil {
		return err
	}
	// The publish checks wait, as the methods after them and the close do,
	// while the broker blocks the connection (a resource alarm): the check
	// then ends unfinished, rather than keep the worker from starting for
	// as long as the alarm lasts; its goroutine closes the connection when
	// the alarm ends.
	blocked := conn.NotifyBlocked(make(chan amqp091.Blocking, 4))
	done := make(chan error, 1)
	go func() {
		defer func() { _ = conn.Close() }()
		done <- c.checkAccess(ctx, conn)
	}()
	for {
		select {
		case err := <-done:
			return err
		case b, ok := <-blocked:
			if !ok {
				blocked = nil
				continue
			}
			if b.Active {
				c.log.Warn("remote control: permissions not all checked: the broker blocks publishing (a resource alarm)",
					zap.String("reason", b.Reason))
				return nil
			}
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// checkAccess is CheckAccess's steps on conn.
func (c *Controller) checkAccess(ctx context.Context, conn *amqp091.Connection) error {
	q := c.queueName()
	steps := []struct {
		op, name, what string
		do             func(ch *amqp091.Channel) error
	}{
		{"declare exchange", EventExchange, "events", func(ch *amqp091.Channel) error {
			return ch.ExchangeDeclare(EventExchange, "topic", true, false, false, false, nil)
		}},
		{"declare exchange", PidboxExchange, "remote control", func(ch *amqp091.Channel) error {
			return ch.ExchangeDeclare(PidboxExchange, "fanout", false, false, false, false, nil)
		}},
		{"declare exchange", ReplyExchange, "remote control replies", func(ch *amqp091.Channel) error {
			return ch.ExchangeDeclare(ReplyExchange, "direct", false, false, false, false, nil)
		}},
		{"declare queue", q, "remote control (the node's mailbox)", func(ch *amqp091.Channel) error {
			args := amqp091.Table{"x-expires": pidboxQueueExpires, "x-message-ttl": pidboxQueueTTL}
			_, err := ch.QueueDeclare(q, false, true, false, false, args)
			return err
		}},
		{"bind queue", q, "remote control (the node's mailbox)", func(ch *amqp091.Channel) error { return ch.QueueBind(q, "", PidboxExchange, false, nil) }},
		{"get", q, "remote control (the node's mailbox)", func(ch *amqp091.Channel) error {
			d, ok, err := ch.Get(q, false)
			if err == nil && ok {
				err = d.Nack(false, true)
			}
			return err
		}},
		// With the routing key of the heartbeat, which the worker always
		// sends: a topic permission on celeryev that lets the worker's
		// events through lets the check through.
		{"publish", EventExchange, "events", func(ch *amqp091.Channel) error {
			return amqp.CheckWriteOn(ctx, ch, EventExchange, celeryproto.EventRoutingKey("worker-heartbeat"))
		}},
		// A reply's routing key is the asking client's own (a uuid); the
		// exchange is a direct one, to which topic permissions do not
		// apply.
		{"publish", ReplyExchange, "remote control replies", func(ch *amqp091.Channel) error {
			return amqp.CheckWriteOn(ctx, ch, ReplyExchange, c.cfg.NodeName)
		}},
	}
	for _, s := range steps {
		ch, err := conn.Channel()
		if err != nil {
			return fmt.Errorf("control: open channel: %w", err)
		}
		err = s.do(ch)
		_ = ch.Close()
		if ae := amqp.AccessRefusal(s.op, err); ae != nil {
			return fmt.Errorf("control: %s %s: %w", s.op, s.name, amqp.AccessFor(ae, s.what))
		}
		if err != nil {
			return fmt.Errorf("control: %s %s: %w", s.op, s.name, err)
		}
	}
	return nil
}
