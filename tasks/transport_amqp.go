package tasks

// The AMQP transport (transport.go): Celery messages from RabbitMQ. A
// delivery is acknowledged on the channel it came on (late acks, coalesced
// by the amqp package), given back with a nack that requeues it, and held by
// leaving it unacknowledged, the prefetch window grown for it; it is stale
// once its channel is gone (the broker then redelivers it). Its copies
// (republished, retried, quarantined) are published with a confirm before
// the delivery is acknowledged: a crash in between leaves two copies, and
// the record answers the second.

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/clip"
)

// amqpTransport consumes the configured queues with its consumer and
// publishes its deliveries' copies with pub (the worker's publisher, which
// also sends results and workflow steps).
type amqpTransport struct {
	consumer *amqp.Consumer
	pub      *amqp.Publisher
	queues   []amqp.QueueSpec // the configured queues (Config.Queues)
}

func newAMQPTransport(cfg *Config, pub *amqp.Publisher) *amqpTransport {
	return &amqpTransport{
		consumer: amqp.NewConsumer(cfg.Broker, amqp.ConsumerConfig{Queues: cfg.Queues, Prefetch: cfg.Prefetch, Tag: cfg.Hostname,
			DrainTimeout: cfg.Grace + 10*time.Second}),
		pub:    pub,
		queues: cfg.Queues,
	}
}

// prepare declares each configured queue's quarantine queue, and checks
// that the broker lets the worker publish where it will: to the default
// exchange, with a queue's name as the routing key (results for rpc://,
// retries, republished and quarantined copies), so that a missing write
// permission stops the worker at start (amqp.AccessError) rather than
// each message that needs it. Every copy of a delivery goes back to its
// queue through the default exchange, whatever exchange it came by (the
// application's, a dead-letter exchange): no write on those is needed.
func (t *amqpTransport) prepare(ctx context.Context) error {
	for _, q := range t.queues {
		if err := t.declareQuarantine(ctx, q); err != nil {
			return err
		}
	}
	key := ""
	if len(t.queues) > 0 {
		key = t.queues[0].Name
	}
	if err := t.pub.CheckWrite(ctx, "", key); err != nil {
		return fmt.Errorf("tasks: %w", amqp.AccessFor(err, "results, retries, republished and quarantined copies"))
	}
	return nil
}

// declareQuarantine makes sure the quarantine queue of work queue q
// exists: an existing one is used as it is (a passive check first, as for
// work queues); a missing one is declared with q's queue type, so that the
// quarantine queue of a quorum queue is replicated as its work queue is
// (a classic one lives on one node, and a worker started while that node
// is down could not declare it).
func (t *amqpTransport) declareQuarantine(ctx context.Context, q amqp.QueueSpec) error {
	// Bound to nothing but the default exchange, which the copies go
	// through: only configure permission on the queue is needed.
	spec := amqp.QueueSpec{Name: quarantineName(q.Name), Exchange: amqp.DefaultExchange, Durable: true, Quorum: q.IsQuorum()}
	if err := t.pub.Declare(ctx, spec); err != nil {
		return fmt.Errorf("tasks: declare quarantine queue %s: %w", spec.Name, amqp.AccessFor(err, "the quarantine queue of "+q.Name))
	}
	return nil
}

func (t *amqpTransport) consume(ctx context.Context, receive func(delivery)) error {
	return t.consumer.Run(ctx, func(d *amqp.Delivery) { receive(&amqpDelivery{d: d, t: t}) })
}

func (t *amqpTransport) ready() bool                { return t.consumer.Ready() }
func (t *amqpTransport) setPrefetch(n int) error    { return t.consumer.SetPrefetch(n) }
func (t *amqpTransport) setWindowLimit(n int) error { return t.consumer.SetWindowLimit(n) }
func (t *amqpTransport) close() error               { return t.pub.Close() }

// fixedWindow reports whether a queue consumed is a quorum queue, as found
// on the broker: a quorum queue counts its window per consumer, and a
// change of it restarts the consumers.
func (t *amqpTransport) fixedWindow() bool {
	for _, q := range t.consumer.Queues() {
		if q.IsQuorum() {
			return true
		}
	}
	return false
}

// addQueue starts consuming q, declared as a configured queue is (with its
// quarantine queue).
func (t *amqpTransport) addQueue(ctx context.Context, q amqp.QueueSpec) error {
	if err := t.declareQuarantine(ctx, q); err != nil {
		return err
	}
	if err := t.consumer.AddQueue(q); err != nil {
		return fmt.Errorf("tasks: %w", err)
	}
	return nil
}

// publish publishes with a confirm, bounded by opTimeout except while the
// broker blocks publishing (Worker.publish).
func (t *amqpTransport) publish(ctx context.Context, exchange, key string, p *celeryproto.Publishing, o amqp.PublishOptions) error {
	o.Timeout = opTimeout
	return t.pub.Publish(ctx, exchange, key, p, o)
}

// quarantineName is the quarantine queue of queue q.
func quarantineName(q string) string { return q + ".quarantine" }

// amqpDelivery is a delivery of the AMQP transport.
type amqpDelivery struct {
	d *amqp.Delivery
	t *amqpTransport
}

func (a *amqpDelivery) wire() *celeryproto.Delivery { return &a.d.Delivery }

func (a *amqpDelivery) origin() origin {
	return origin{Queue: a.d.Queue, Exchange: a.d.Exchange, RoutingKey: a.d.RoutingKey, Priority: a.d.Priority}
}

// redelivered is the broker's redelivered flag.
func (a *amqpDelivery) redelivered() bool { return a.d.Redelivered }

// deliveryCount is a quorum queue's x-delivery-count on a redelivery, else
// 0 (amqp.Delivery.DeliveryCount).
func (a *amqpDelivery) deliveryCount() int { return a.d.DeliveryCount }

// deliveryLimit is the quorum queue's x-delivery-limit, 0 if none
// (amqp.Delivery.DeliveryLimit).
func (a *amqpDelivery) deliveryLimit() int { return a.d.DeliveryLimit }

// passOn publishes a copy to the queue the delivery came from (default
// exchange, confirmed), with HeaderDeliveries set to deliveries and without
// x-delivery-count: the quorum queue counts the copy's deliveries afresh.
func (a *amqpDelivery) passOn(ctx context.Context, deliveries int) error {
	h := maps.Clone(withoutBrokerHeaders(a.d.Headers))
	if h == nil {
		h = map[string]any{}
	}
	h[HeaderDeliveries] = int64(deliveries)
	return a.t.publish(ctx, "", a.d.Queue, a.copyOf(h), amqp.PublishOptions{Mandatory: true})
}

// stale reports whether the delivery's channel is gone.
func (a *amqpDelivery) stale() bool { return a.d.Stale() }

func (a *amqpDelivery) ack() error { return a.d.Ack() }

// giveBack is a nack that requeues the message (redelivered set).
func (a *amqpDelivery) giveBack() error { return a.d.Nack(true) }

// copyOf is a publishing of the delivery's message as it came, with
// headers h.
func (a *amqpDelivery) copyOf(h map[string]any) *celeryproto.Publishing {
	d := a.d
	return &celeryproto.Publishing{
		ContentType: d.ContentType, ContentEncoding: d.ContentEncoding, Headers: h, Body: d.Body,
		CorrelationID: d.CorrelationID, ReplyTo: d.ReplyTo, DeliveryMode: 2, Priority: d.Priority,
	}
}

// republish publishes a copy to the queue the delivery came from (default
// exchange, confirmed); its ETA is in the message.
func (a *amqpDelivery) republish(ctx context.Context, _ time.Time) error {
	return a.t.publish(ctx, "", a.d.Queue, a.copyOf(withoutBrokerHeaders(a.d.Headers)), amqp.PublishOptions{Mandatory: true})
}

// retry publishes next as a new Celery message (protocol 2, the
// delivery's serializer) to the queue the delivery came from, through the
// default exchange, confirmed: the queue Celery's retry reaches by the
// exchange and routing key the message came with, without the write
// permission on that exchange (the application's own, or a dead-letter
// exchange the message came by).
func (a *amqpDelivery) retry(ctx context.Context, next *celeryproto.Message, _ *RetryRequest) error {
	m := *next
	m.Headers = withoutBrokerHeaders(m.Headers)
	pub, err := celeryproto.EncodeTask(&m, celeryproto.EncodeOptions{Protocol: 2, Serializer: m.Serializer()})
	if err != nil {
		return &encodeError{err}
	}
	return a.t.publish(ctx, "", a.d.Queue, pub, amqp.PublishOptions{Mandatory: true})
}

// quarantine publishes a copy to the quarantine queue of the delivery's
// queue (default exchange, confirmed), its headers cut to fit a frame
// (fitHeaders); a copy the broker refuses for what it is goes again
// without the original headers.
func (a *amqpDelivery) quarantine(ctx context.Context, ours map[string]any) error {
	q := quarantineName(a.d.Queue)
	p := a.copyOf(fitHeaders(a.d.Headers, ours))
	err := a.t.publish(ctx, "", q, p, amqp.PublishOptions{Mandatory: true})
	if amqp.IsPermanent(err) {
		// Only the copy's own headers: the original ones could not go.
		h := make(map[string]any, len(ours)+1)
		for k, v := range ours {
			h[k] = v
		}
		h[HeaderTruncated] = clip.String("all original headers left out: "+err.Error(), maxDetail)
		p.Headers = h
		err = a.t.publish(ctx, "", q, p, amqp.PublishOptions{Mandatory: true})
	}
	return err
}

// keep encodes the delivery as a heldMessage.
func (a *amqpDelivery) keep() ([]byte, error) {
	d := a.d
	h := heldMessage{Exchange: d.Exchange, RoutingKey: d.RoutingKey, Queue: d.Queue, CapturedAt: time.Now().UTC(),
		Redelivered: d.Redelivered, Publishing: a.copyOf(d.Headers)}
	b, err := json.Marshal(h)
	if err != nil {
		return nil, fmt.Errorf("encode held message: %w", err)
	}
	return b, nil
}

// withoutBrokerHeaders returns h without the headers the broker sets on a
// delivery (x-delivery-count, dead-lettering history): a new message that
// copies them would look redelivered (a quorum queue's delivery count is
// what the poison check reads). h itself is not changed.
func withoutBrokerHeaders(h map[string]any) map[string]any {
	drop := func(k string) bool {
		return k == "x-delivery-count" || k == "x-death" || strings.HasPrefix(k, "x-first-death-") ||
			strings.HasPrefix(k, "x-last-death-")
	}
	n := 0
	for k := range h {
		if drop(k) {
			n++
		}
	}
	if n == 0 {
		return h
	}
	out := make(map[string]any, len(h)-n)
	for k, v := range h {
		if !drop(k) {
			out[k] = v
		}
	}
	return out
}

// fitHeaders returns the headers of a quarantine copy: the delivery's
// headers h with ours added, cut to maxQuarantineHeaders when they do not
// fit (HeaderTruncated then says what was cut). h is not changed.
func fitHeaders(h, ours map[string]any) map[string]any {
	out := make(map[string]any, len(h)+len(ours)+1)
	for k, v := range h {
		out[k] = v
	}
	for k, v := range ours {
		out[k] = v
	}
	if n, err := amqp.HeadersSize(out); err == nil && n <= maxQuarantineHeaders {
		return out
	}
	out = make(map[string]any, len(ours)+1)
	for k, v := range ours {
		out[k] = v
	}
	used, _ := amqp.HeadersSize(out)
	used += maxDetail + 64 // HeaderTruncated
	keys := make([]string, 0, len(h))
	for k := range h {
		if _, mine := ours[k]; !mine {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	var cut, left []string
	for _, k := range keys {
		v := h[k]
		n, err := amqp.HeadersSize(map[string]any{k: v})
		if err != nil || n > maxQuarantineValue+len(k)+16 {
			v = cutValue(v)
			cut = append(cut, fmt.Sprintf("%s (%d bytes)", k, n))
			n, _ = amqp.HeadersSize(map[string]any{k: v})
		}
		if used+n > maxQuarantineHeaders {
			left = append(left, k)
			continue
		}
		out[k] = v
		used += n
	}
	var b strings.Builder
	fmt.Fprintf(&b, "headers cut to fit a frame (each to %d bytes, %d in all)", maxQuarantineValue, maxQuarantineHeaders)
	if len(cut) > 0 {
		b.WriteString("; cut: " + strings.Join(cut, ", "))
	}
	if len(left) > 0 {
		b.WriteString("; left out: " + strings.Join(left, ", "))
	}
	out[HeaderTruncated] = clip.String(b.String(), maxDetail)
	return out
}

// cutValue is a header value cut to maxQuarantineValue bytes: text and
// bytes keep their first bytes, other values become their text form, cut.
func cutValue(v any) any {
	switch x := v.(type) {
	case string:
		return clip.String(x, maxQuarantineValue)
	case []byte:
		return clip.String(string(x), maxQuarantineValue)
	}
	return clip.String(fmt.Sprint(v), maxQuarantineValue)
}
