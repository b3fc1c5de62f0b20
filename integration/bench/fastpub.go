package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceler/onceler/celeryproto"
)

// producer pre-fills the bench's queues on one confirm-mode channel with
// many confirms outstanding, so that it does not wait a broker round trip
// per message, and publishes the steady load of the latency runs on a
// second channel without confirms (publishSteady).
type producer struct {
	conn  *amqp091.Connection
	ch    *amqp091.Channel
	plain *amqp091.Channel // no confirms: the steady load, as Celery's producers publish
	acks  chan amqp091.Confirmation

	mu      sync.Mutex
	cond    *sync.Cond
	pending int
	nacked  int
	closed  bool
	done    chan struct{}
}

const maxOutstanding = 4096

func newProducer(amqpURL string) (*producer, error) {
	conn, err := amqp091.DialConfig(amqpURL, amqp091.Config{Properties: amqp091.Table{"connection_name": "onceler-bench-producer"}})
	if err != nil {
		return nil, fmt.Errorf("producer: dial: %w", err)
	}
	ch, err := conn.Channel()
	if err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("producer: channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("producer: confirm mode: %w", err)
	}
	plain, err := conn.Channel()
	if err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("producer: channel: %w", err)
	}
	p := &producer{conn: conn, ch: ch, plain: plain, acks: ch.NotifyPublish(make(chan amqp091.Confirmation, maxOutstanding+16)),
		done: make(chan struct{})}
	p.cond = sync.NewCond(&p.mu)
	go p.watch()
	return p, nil
}

// watch counts confirms until the channel closes.
func (p *producer) watch() {
	defer close(p.done)
	for c := range p.acks {
		p.mu.Lock()
		p.pending--
		if !c.Ack {
			p.nacked++
		}
		p.cond.Broadcast()
		p.mu.Unlock()
	}
	p.mu.Lock()
	p.closed = true
	p.cond.Broadcast()
	p.mu.Unlock()
}

// publish sends m to queue through the default exchange once fewer than
// maxOutstanding confirms are awaited.
func (p *producer) publish(ctx context.Context, queue string, m *celeryproto.Publishing) error {
	p.mu.Lock()
	for p.pending >= maxOutstanding && !p.closed {
		p.cond.Wait()
	}
	if p.closed {
		p.mu.Unlock()
		return errors.New("producer: channel closed")
	}
	p.pending++
	p.mu.Unlock()
	if err := p.ch.PublishWithContext(ctx, "", queue, false, false, amqpPublishing(m)); err != nil {
		return fmt.Errorf("producer: publish: %w", err)
	}
	return nil
}

// wait returns once every published message is confirmed; an error when
// the broker refused any.
func (p *producer) wait() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for p.pending > 0 && !p.closed {
		p.cond.Wait()
	}
	switch {
	case p.pending > 0:
		return fmt.Errorf("producer: channel closed with %d messages unconfirmed", p.pending)
	case p.nacked > 0:
		return fmt.Errorf("producer: broker refused %d messages", p.nacked)
	}
	return nil
}

func (p *producer) close() {
	_ = p.conn.Close()
	<-p.done
}

// publishAll publishes msgs to queue and waits for every confirm.
func publishAll(ctx context.Context, p *producer, queue string, msgs []*celeryproto.Publishing) error {
	for i, m := range msgs {
		if err := p.publish(ctx, queue, m); err != nil {
			return fmt.Errorf("message %d: %w", i, err)
		}
	}
	return p.wait()
}

// publishSteady publishes msgs at rate per second, as Celery's producers
// publish (py-amqp's confirm_publish is off by default): persistent, on a
// channel without publisher confirms, so the broker does not confirm every
// message of the load on the cores it shares with the worker. It returns
// when each message was handed to the channel. Nothing is lost unnoticed:
// the latency run fails unless the worker answers every message.
func publishSteady(ctx context.Context, p *producer, queue string, msgs []*celeryproto.Publishing, rate float64) ([]time.Time, error) {
	sent := make([]time.Time, len(msgs))
	start := time.Now()
	tick := time.NewTicker(200 * time.Microsecond)
	defer tick.Stop()
	next := 0
	for next < len(msgs) {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-tick.C:
		}
		due := min(len(msgs), int(time.Since(start).Seconds()*rate)+1)
		for ; next < due; next++ {
			sent[next] = time.Now()
			if err := p.plain.PublishWithContext(ctx, "", queue, false, false, amqpPublishing(msgs[next])); err != nil {
				return nil, fmt.Errorf("message %d: %w", next, err)
			}
		}
	}
	return sent, nil
}

// amqpPublishing is m as amqp091 publishes it.
func amqpPublishing(m *celeryproto.Publishing) amqp091.Publishing {
	return amqp091.Publishing{
		ContentType: m.ContentType, ContentEncoding: m.ContentEncoding, Headers: amqp091.Table(m.Headers),
		Body: m.Body, CorrelationId: m.CorrelationID, ReplyTo: m.ReplyTo, DeliveryMode: m.DeliveryMode,
		Priority: m.Priority, Expiration: m.Expiration,
	}
}
