package amqp

import (
	"errors"
	"fmt"
	"math"
	"sync/atomic"

	"github.com/onceler/onceler/celeryproto"
	amqp091 "github.com/onceler/onceler/internal/amqp091"
	"github.com/onceler/onceler/internal/intval"
)

// Delivery is one message handed over by the broker. Ack, Nack and Reject
// answer on the channel the message came on; once that channel is gone they
// return ErrStaleDelivery and send nothing, and the broker delivers the
// message again. A Delivery must not be copied.
type Delivery struct {
	celeryproto.Delivery
	// Queue is the queue the message was consumed or got from.
	Queue string
	// Exchange and RoutingKey are those it was published with.
	Exchange, RoutingKey string
	// DeliveryCount is how many times the broker delivered the message
	// before: a quorum queue's x-delivery-count header on a redelivery, else
	// 0 (see newDelivery for why a producer's header is not trusted).
	DeliveryCount int
	// DeliveryLimit is the x-delivery-limit argument of a quorum queue, as
	// found when consuming started (see QueueSpec.DeliveryLimit); 0 when it
	// has none. RabbitMQ drops the message (or dead-letters it) when it
	// returns after the delivery whose DeliveryCount equals the limit.
	DeliveryLimit int
	// MessageID is the AMQP message_id property, empty if unset.
	MessageID string

	tag     uint64
	ch      *channelState
	settled atomic.Bool
}

// channelState is one AMQP channel's life: deliveries point at the state of
// the channel they came on, never at whatever channel is current.
type channelState struct {
	ch     *amqp091.Channel
	gen    uint64
	closed atomic.Bool
	// outstanding counts deliveries handed out and not yet settled.
	outstanding atomic.Int64
	// acks coalesces the channel's acknowledgements.
	acks acker
}

func (s *channelState) dead() bool {
	return s.closed.Load() || s.ch.IsClosed()
}

// Stale reports whether the channel this delivery came on is gone, so that
// acknowledging it is no longer possible.
func (d *Delivery) Stale() bool { return d.ch == nil || d.ch.dead() }

// Ack acknowledges the delivery: the broker forgets it. Acknowledgements
// of one channel are coalesced: when this delivery and every earlier one of
// its channel are settled, one basic.ack with multiple=true may answer them
// together, sent by this call or by a concurrent one (whose write may still
// be under way when this returns; if it fails, the channel is gone and the
// broker delivers the message again). Only settled deliveries are ever
// covered; a delivery settled while an earlier one is still out is
// acknowledged on its own at once.
func (d *Delivery) Ack() error {
	return d.settle("ack", func(st *channelState) error {
		return st.acks.ack(d.tag, func(tag uint64, multiple bool) error { return st.ch.Ack(tag, multiple) })
	})
}

// Nack rejects the delivery; with requeue the broker queues it again
// (redelivered=true), without it the broker drops or dead-letters it.
func (d *Delivery) Nack(requeue bool) error {
	return d.refuse("nack", func(ch *amqp091.Channel) error { return ch.Nack(d.tag, false, requeue) })
}

// Reject is basic.reject: like Nack, for one message.
func (d *Delivery) Reject(requeue bool) error {
	return d.refuse("reject", func(ch *amqp091.Channel) error { return ch.Reject(d.tag, requeue) })
}

// refuse sends a nack or reject at once and only then counts the delivery
// settled for the acker, so that no multiple ack can cover it first.
func (d *Delivery) refuse(op string, send func(*amqp091.Channel) error) error {
	return d.settle(op, func(st *channelState) error {
		if err := send(st.ch); err != nil {
			return err
		}
		st.acks.settledElsewhere(d.tag)
		return nil
	})
}

func (d *Delivery) settle(op string, send func(*channelState) error) error {
	if d.ch == nil {
		return fmt.Errorf("%s: %w", op, ErrStaleDelivery)
	}
	if d.ch.dead() {
		return fmt.Errorf("%s delivery %d of channel generation %d: %w", op, d.tag, d.ch.gen, ErrStaleDelivery)
	}
	if d.settled.Swap(true) {
		return fmt.Errorf("%s delivery %d: %w", op, d.tag, ErrAlreadySettled)
	}
	if err := send(d.ch); err != nil {
		if errors.Is(err, amqp091.ErrClosed) || d.ch.dead() {
			return fmt.Errorf("%s delivery %d of channel generation %d: %w", op, d.tag, d.ch.gen, ErrStaleDelivery)
		}
		d.settled.Store(false)
		return fmt.Errorf("%s delivery %d: %w", op, d.tag, err)
	}
	d.ch.outstanding.Add(-1)
	return nil
}

// newDelivery converts an amqp091 delivery. Its header table is converted
// in place. quorum says the queue is a quorum queue.
//
// x-delivery-count is trusted only where the broker wrote it: on a
// redelivery (Redelivered set) from a quorum queue, which overwrites the
// header with its own count then. A classic queue never sets it and passes
// a producer's header through untouched, so there it is ignored (the worker
// counts classic redeliveries itself); and a first delivery (Redelivered
// unset) was not delivered before, whatever the header says: a quorum
// queue passes a producer's header through on it too. Otherwise any
// producer could have a message quarantined as poison on its first
// delivery with x-delivery-count: 99.
func newDelivery(m *amqp091.Delivery, queue string, quorum bool, st *channelState) *Delivery {
	d := &Delivery{
		Delivery: celeryproto.Delivery{
			ContentType:     m.ContentType,
			ContentEncoding: m.ContentEncoding,
			Headers:         fromTable(m.Headers),
			HeadersError:    m.HeadersError,
			Body:            m.Body,
			CorrelationID:   m.CorrelationId,
			ReplyTo:         m.ReplyTo,
			Priority:        m.Priority,
			DeliveryMode:    m.DeliveryMode,
			Expiration:      m.Expiration,
			Redelivered:     m.Redelivered,
		},
		Queue:      queue,
		Exchange:   m.Exchange,
		RoutingKey: m.RoutingKey,
		MessageID:  m.MessageId,
		tag:        m.DeliveryTag,
		ch:         st,
	}
	if v, ok := d.Headers["x-delivery-count"]; ok && quorum && m.Redelivered {
		n, _ := intval.Int(v)
		d.DeliveryCount = int(min(max(n, 0), math.MaxInt32))
	}
	return d
}
