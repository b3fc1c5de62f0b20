package amqp

import (
	"context"
	"errors"
	"fmt"

	amqp091 "github.com/onceler/onceler/internal/amqp091"
)

// InspectAction says what Inspect does with a message after its callback.
type InspectAction int

const (
	// Keep leaves the message in the queue; it is requeued when Inspect
	// ends (with redelivered set), keeping its place for classic queues.
	Keep InspectAction = iota
	// Remove acknowledges the message: it leaves the queue for good. Use it
	// after the message was safely republished elsewhere, or to drop it.
	Remove
	// Stop keeps the message and ends Inspect.
	Stop
)

// Inspect reads up to limit messages from queue (limit <= 0: the messages
// the queue holds when the walk starts; those that arrive during it, such as
// one a worker quarantines again right after it was requeued, wait for the
// next walk) with basic.get on a channel of its own, without consuming, and
// calls fn for
// each; fn's answer decides whether the message stays or goes. Kept messages
// stay unacknowledged until Inspect returns, so each message is seen once,
// then they all go back to the queue. Meant for operator tools (listing,
// requeueing or dropping quarantined messages), not for throughput: each
// message is one round trip. An error from fn stops the walk, keeps the
// message and is returned. It returns how many messages fn saw.
func (p *Publisher) Inspect(ctx context.Context, queue string, limit int, fn func(*Delivery) (InspectAction, error)) (int, error) {
	seen := 0
	err := p.withChannel(ctx, func(ch *amqp091.Channel) error {
		st := &channelState{ch: ch}
		st.acks.eager = true // Remove acknowledges before the walk goes on
		if limit <= 0 {
			q, err := ch.QueueDeclarePassive(queue, false, false, false, false, nil)
			if err != nil {
				if ae := brokerError(err); ae != nil && ae.Code == amqp091.NotFound {
					return fmt.Errorf("inspect %q: %w: %s", queue, ErrNotFound, ae.Reason)
				}
				return fmt.Errorf("inspect %q: depth: %w", queue, err)
			}
			limit = q.Messages
			if limit == 0 {
				return nil
			}
		}
		for seen < limit {
			if err := ctx.Err(); err != nil {
				return fmt.Errorf("inspect %q: %w", queue, err)
			}
			m, ok, err := ch.Get(queue, false)
			if err != nil {
				if ae := brokerError(err); ae != nil && ae.Code == amqp091.NotFound {
					return fmt.Errorf("inspect %q: %w: %s", queue, ErrNotFound, ae.Reason)
				}
				return fmt.Errorf("inspect %q: get: %w", queue, err)
			}
			if !ok {
				return nil
			}
			seen++
			st.outstanding.Add(1)
			d := newDelivery(&m, queue, false, st) // the type is unknown: counts are not read
			action, ferr := fn(d)
			if ferr != nil {
				return ferr
			}
			switch action {
			case Remove:
				if err := d.Ack(); err != nil && !errors.Is(err, ErrAlreadySettled) {
					return fmt.Errorf("inspect %q: remove: %w", queue, err)
				}
			case Stop:
				return nil
			}
		}
		return nil
	})
	return seen, err
}
