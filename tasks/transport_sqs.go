package tasks

// The SQS transport (transport.go): messages from Amazon SQS queues
// (Config.SQS, package sqs). Each queue is long-polled by a few receivers,
// up to ten messages a receive, while the prefetch window has room. A
// received message is invisible to other consumers for its visibility
// timeout; the transport extends it (ChangeMessageVisibility) every third
// of that while the delivery is held or runs, and deletes the message
// when the delivery is acked (after the record's completion), in batches.
// giveBack makes it visible again at once; a delivery whose extension
// finds the message no longer in flight (or that passed its deadline
// unextended) is stale: the queue delivers it again, and the record
// answers that. Copies (republish, retry, quarantine, chain steps) are
// sent before the original is deleted: a crash in between leaves two, and
// the record answers the second. Every copy keeps within SQS's ten
// attributes and the queue's MaximumMessageSize, the attributes the worker
// reads first (copyOf, quarantineCopy); one that cannot, or that SQS
// refuses for what it is, is an *amqp.RefusedError (sqsRefused), which
// the pipeline's refused paths take.
//
// A message is a Celery message in kombu's envelope (sqs.DecodeKombu) or a
// plain one: its body the task's arguments as JSON (a list: positional, an
// object: keyword), its task the "task" attribute or the queue's
// (sqs.Queue.Task), its id the "task_id" attribute or the SQS message id,
// its idempotency key the "idempotency_key" attribute. Either is read in
// Celery's wire form; a message that is neither, or whose task is not
// named, reaches the decode stage as undecodable and is quarantined: to the
// queue's dead-letter queue when its redrive policy names one, else to
// "<queue>-quarantine", with the reason as message attributes.
//
// A FIFO queue's messages are handed to the pipeline one at a time per
// message group, in the order received: the next once the one before is
// settled.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/clip"
	"github.com/onceler/onceler/internal/pause"
	"github.com/onceler/onceler/sqs"
)

// sqsQueue is a queue the transport consumes.
type sqsQueue struct {
	sqs.Queue
	url        string
	visibility time.Duration
	fifo       bool
	// maxSize is its MaximumMessageSize.
	maxSize int
	// quarantine is the URL of its quarantine queue, quarantineMax that
	// queue's MaximumMessageSize.
	quarantine, quarantineName string
	quarantineMax              int
}

// sqsTransport consumes cfg.Queues through client.
type sqsTransport struct {
	cfg    sqs.Config
	client *sqs.Client
	log    *zap.Logger
	queues []*sqsQueue
	byName map[string]*sqsQueue
	// pollers is the number of receivers per queue.
	pollers int

	mu       sync.Mutex
	out      int // messages received and not settled (or reserved for a receive)
	prefetch int
	limit    int
	kick     chan struct{}
	failing  atomic.Bool
	// failed counts a receive that failed (the worker's metric); nil: none.
	failed func()
	// held are the deliveries whose messages may still be in flight
	// under their receipt handles (not settled, not stale): extended.
	held map[*sqsDelivery]struct{}
	// groups are the FIFO message groups with a delivery in the pipeline:
	// the deliveries of the group waiting behind it.
	groups map[string][]*sqsDelivery
	// pending are the deliveries to hand to the pipeline (consume).
	pending []*sqsDelivery
	// stopped: consume has returned; a delivery dispatched after it (the
	// next of a FIFO group) is handed back instead.
	stopped   bool
	readyKick chan struct{}
	backs     sync.WaitGroup
	// The extender: started by consume, stopped by close.
	extendOnce sync.Once
	stopExtend context.CancelFunc
	extendDone chan struct{}
}

func newSQSTransport(cfg *Config, log *zap.Logger) *sqsTransport {
	scfg := *cfg.SQS
	if scfg.Logger == nil {
		scfg.Logger = log
	}
	if scfg.Wait <= 0 {
		scfg.Wait = 10 * time.Second
	}
	scfg.Wait = min(scfg.Wait, sqs.MaxWait)
	return &sqsTransport{cfg: scfg, log: log, prefetch: cfg.Prefetch, kick: make(chan struct{}, 1), readyKick: make(chan struct{}, 1),
		held: map[*sqsDelivery]struct{}{}, groups: map[string][]*sqsDelivery{}, byName: map[string]*sqsQueue{},
		pollers: min(max(cfg.Prefetch/sqs.MaxBatch, 1), 8)}
}

// prepare opens the client and finds each queue, its visibility timeout
// and its quarantine queue (the dead-letter queue of its redrive policy,
// else "<queue>-quarantine"); a missing queue is created, as kombu does.
func (t *sqsTransport) prepare(ctx context.Context) error {
	c, err := sqs.New(ctx, t.cfg)
	if err != nil {
		return fmt.Errorf("tasks: %w", err)
	}
	t.client = c
	for _, q := range t.cfg.Queues {
		info, err := c.Info(ctx, q.Name, true)
		if err != nil {
			return fmt.Errorf("tasks: %w", err)
		}
		sq := &sqsQueue{Queue: q, url: info.URL, fifo: info.FIFO, visibility: t.cfg.Visibility, maxSize: info.MaxMessageSize}
		if sq.visibility <= 0 {
			sq.visibility = info.Visibility
		}
		sq.visibility = min(max(sq.visibility, 2*time.Second), sqs.MaxVisibility)
		sq.quarantineName = info.DeadLetter
		if sq.quarantineName != "" {
			qi, err := c.Info(ctx, sq.quarantineName, false)
			if err != nil {
				return fmt.Errorf("tasks: dead-letter queue of %s: %w", q.Name, err)
			}
			sq.quarantine, sq.quarantineMax = qi.URL, qi.MaxMessageSize
		} else {
			sq.quarantineName = sqsQuarantineName(q.Name)
			qi, err := c.Info(ctx, sq.quarantineName, true)
			if err != nil {
				return fmt.Errorf("tasks: quarantine queue of %s: %w", q.Name, err)
			}
			sq.quarantine, sq.quarantineMax = qi.URL, qi.MaxMessageSize
		}
		t.queues = append(t.queues, sq)
		t.byName[q.Name] = sq
	}
	names := make([]string, len(t.queues))
	for i, q := range t.queues {
		names[i] = q.Name
	}
	t.log.Info("consuming SQS queues", zap.Strings("queues", names), zap.Duration("wait", t.cfg.Wait))
	return nil
}

// sqsQuarantineName is the quarantine queue of a queue without a
// dead-letter queue: "<queue>-quarantine" ("<name>-quarantine.fifo" for a
// FIFO queue).
func sqsQuarantineName(q string) string {
	if base, ok := strings.CutSuffix(q, ".fifo"); ok {
		return base + "-quarantine.fifo"
	}
	return q + "-quarantine"
}

// consume runs the receivers until ctx is done, handing the deliveries to
// receive from this goroutine, and starts the extender (stopped by close).
func (t *sqsTransport) consume(ctx context.Context, receive func(delivery)) error {
	var wg sync.WaitGroup
	for _, q := range t.queues {
		for range t.pollers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				t.poll(ctx, q)
			}()
		}
	}
	// The extender runs until close: the messages of tasks still running
	// in the grace period after consume returns are extended too.
	t.extendOnce.Do(func() {
		ectx, cancel := context.WithCancel(context.WithoutCancel(ctx))
		t.stopExtend = cancel
		t.extendDone = make(chan struct{})
		go func() {
			defer close(t.extendDone)
			t.extend(ectx)
		}()
	})
	for {
		t.mu.Lock()
		ready := t.pending
		t.pending = nil
		t.mu.Unlock()
		for _, d := range ready {
			if ctx.Err() != nil || d.stale() {
				_ = d.giveBack()
				continue
			}
			receive(d)
		}
		select {
		case <-ctx.Done():
			wg.Wait()
			t.mu.Lock()
			t.stopped = true
			ready := t.pending
			t.pending = nil
			t.mu.Unlock()
			for _, d := range ready {
				_ = d.giveBack()
			}
			return nil
		case <-t.readyKick:
		}
	}
}

// dispatch queues d for the pipeline (consume); once consume has returned
// (the next of a FIFO group whose message settled in the grace period), d
// is handed back instead.
func (t *sqsTransport) dispatch(d *sqsDelivery) {
	t.mu.Lock()
	if t.stopped {
		t.mu.Unlock()
		_ = d.giveBack()
		return
	}
	t.pending = append(t.pending, d)
	t.mu.Unlock()
	select {
	case t.readyKick <- struct{}{}:
	default:
	}
}

// poll receives from q while the window has room, until ctx is done. A
// receive that fails is tried again at growing intervals up to 5 s.
func (t *sqsTransport) poll(ctx context.Context, q *sqsQueue) {
	for failures := 0; ; {
		n := t.reserve(ctx, sqs.MaxBatch)
		if n == 0 {
			return
		}
		msgs, err := t.client.Receive(ctx, q.Name, n, t.cfg.Wait, q.visibility)
		t.unreserve(n - len(msgs))
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			t.failing.Store(true)
			if t.failed != nil {
				t.failed()
			}
			t.log.Warn("SQS receive failed; retrying", zap.String("queue", q.Name), zap.Error(err))
			if !pause.For(ctx, min(100*time.Millisecond<<min(failures, 6), 5*time.Second)) {
				return
			}
			failures++
			continue
		}
		failures = 0
		t.failing.Store(false)
		for _, m := range msgs {
			d := t.newDelivery(q, m)
			t.mu.Lock()
			t.held[d] = struct{}{}
			wait := false
			if q.fifo {
				k := d.groupKey()
				if _, busy := t.groups[k]; busy {
					t.groups[k] = append(t.groups[k], d)
					wait = true
				} else {
					t.groups[k] = nil
				}
			}
			t.mu.Unlock()
			if !wait {
				t.dispatch(d)
			}
		}
	}
}

// extend extends the visibility of the held deliveries' messages every
// third of their queues' shortest visibility timeout, until ctx is done
// (close).
func (t *sqsTransport) extend(ctx context.Context) {
	every := time.Hour
	for _, q := range t.queues {
		every = min(every, q.visibility/3)
	}
	every = max(every, 500*time.Millisecond)
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		t.extendHeld(ctx)
	}
}

// extendHeld extends each held delivery's message by its queue's
// visibility timeout; a delivery whose message is no longer in flight, or
// whose deadline passed, is stale.
func (t *sqsTransport) extendHeld(ctx context.Context) {
	t.mu.Lock()
	ds := make([]*sqsDelivery, 0, len(t.held))
	for d := range t.held {
		ds = append(ds, d)
	}
	t.mu.Unlock()
	if len(ds) == 0 {
		return
	}
	vs := make([]sqs.Visibility, len(ds))
	starts := make([]time.Time, len(ds))
	for i, d := range ds {
		vs[i] = sqs.Visibility{QueueURL: d.q.url, ReceiptHandle: d.m.ReceiptHandle, Timeout: d.q.visibility}
		starts[i] = time.Now()
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	errs := t.client.SetVisibility(cctx, vs)
	cancel()
	for i, d := range ds {
		switch {
		case errs[i] == nil:
			d.deadline.Store(starts[i].Add(d.q.visibility).UnixNano())
		case errors.Is(errs[i], sqs.ErrGone) || time.Now().UnixNano() > d.deadline.Load():
			if !d.settled.Load() {
				t.log.Warn("SQS message no longer in flight (its visibility timeout ran out): it is delivered again",
					zap.String("queue", d.q.Name), zap.String("message_id", d.m.ID), zap.Error(errs[i]))
				d.drop()
			}
		default:
			t.log.Warn("extending an SQS message's visibility failed; retrying", zap.String("queue", d.q.Name),
				zap.String("message_id", d.m.ID), zap.Error(errs[i]))
		}
	}
}

// reserve waits for room in the window and takes up to n places in it (0:
// ctx is done).
func (t *sqsTransport) reserve(ctx context.Context, n int) int {
	for {
		t.mu.Lock()
		w := t.prefetch
		if t.limit > 0 {
			w = min(w, t.limit)
		}
		room := max(w, 1) - t.out
		if room > 0 {
			k := min(room, n)
			t.out += k
			t.mu.Unlock()
			return k
		}
		t.mu.Unlock()
		select {
		case <-ctx.Done():
			return 0
		case <-t.kick:
		}
	}
}

// unreserve gives n places in the window back.
func (t *sqsTransport) unreserve(n int) {
	if n <= 0 {
		return
	}
	t.mu.Lock()
	t.out -= n
	t.mu.Unlock()
	select {
	case t.kick <- struct{}{}:
	default:
	}
}

func (t *sqsTransport) ready() bool { return !t.failing.Load() }

func (t *sqsTransport) setPrefetch(n int) error {
	t.mu.Lock()
	t.prefetch = n
	t.mu.Unlock()
	select {
	case t.kick <- struct{}{}:
	default:
	}
	return nil
}

func (t *sqsTransport) setWindowLimit(n int) error {
	t.mu.Lock()
	t.limit = n
	t.mu.Unlock()
	select {
	case t.kick <- struct{}{}:
	default:
	}
	return nil
}

func (t *sqsTransport) fixedWindow() bool { return false }

// close stops the extender, waits for the give-backs under way and closes
// the client (its batched deletes sent first). Messages still in flight become visible
// when their visibility timeouts run out.
func (t *sqsTransport) close() error {
	if t.stopExtend != nil {
		t.stopExtend()
		<-t.extendDone
	}
	t.backs.Wait()
	if t.client == nil {
		return nil
	}
	return t.client.Close()
}

// sendStep sends a workflow step (a chain's next task, ...) to the SQS
// queue named queue, as kombu would.
func (t *sqsTransport) sendStep(ctx context.Context, queue string, p *celeryproto.Publishing) error {
	body, err := sqs.EncodeKombu(p, queue)
	if err != nil {
		return &encodeError{err}
	}
	ctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	u, err := t.client.QueueURL(ctx, queue)
	if err != nil {
		return err
	}
	_, err = t.client.Send(ctx, u, sqs.Outgoing{Body: body})
	return sqsRefused(queue, err)
}

// sqsRefused is err, a send to the queue, as an *amqp.RefusedError when
// SQS refused the message for what it is (sqs.ErrRefused): the pipeline's
// refused paths take it (amqp.IsPermanent), as a publish RabbitMQ refuses.
func sqsRefused(queue string, err error) error {
	if err == nil || !errors.Is(err, sqs.ErrRefused) {
		return err
	}
	return &amqp.RefusedError{Op: "SQS send to queue", RoutingKey: clip.String(queue, 128),
		Reason: clip.String(err.Error(), 512), Err: err}
}

// newDelivery is the delivery of a received message.
func (t *sqsTransport) newDelivery(q *sqsQueue, m sqs.Message) *sqsDelivery {
	d := &sqsDelivery{t: t, q: q, m: m}
	d.deadline.Store(m.Received.Add(q.visibility).UnixNano())
	d.w, d.kombu = sqsWire(q, m)
	return d
}

// sqsWire is a message in Celery's wire form, and whether it is a Celery
// message (kombu's envelope).
func sqsWire(q *sqsQueue, m sqs.Message) (*celeryproto.Delivery, bool) {
	redelivered := m.ReceiveCount > 1
	k, err := sqs.DecodeKombu(m.Body)
	if err == nil {
		d := k.Delivery
		d.ReplyTo = "" // no reply queues over SQS (rpc:// does not exist there)
		d.Redelivered = redelivered
		return &d, true
	}
	if !errors.Is(err, sqs.ErrNotKombu) {
		return &celeryproto.Delivery{ContentType: "application/json", ContentEncoding: "utf-8",
			HeadersError: err, Redelivered: redelivered}, true
	}
	err = nil
	task := m.Attributes["task"]
	if task == "" {
		task = q.Task
	}
	m2 := &celeryproto.Message{Task: task, ID: m.Attributes["task_id"]}
	if m2.ID == "" {
		m2.ID = m.ID
	}
	if task == "" {
		err = fmt.Errorf("plain SQS message %s names no task (a \"task\" attribute, or a task for queue %s)", m.ID, q.Name)
	}
	if err == nil {
		if r := m.Attributes["retries"]; r != "" {
			m2.Retries, err = strconv.Atoi(r)
			if err != nil {
				err = fmt.Errorf("plain SQS message %s: retries attribute %q: %w", m.ID, r, err)
			}
		}
	}
	if err == nil {
		dec := json.NewDecoder(strings.NewReader(m.Body))
		dec.UseNumber()
		var v any
		if err = dec.Decode(&v); err != nil || dec.More() {
			err = fmt.Errorf("plain SQS message %s: the body is not one JSON value (the task's arguments)", m.ID)
		} else {
			switch x := rawNumbers(v).(type) {
			case []any:
				m2.Args = x
			case map[string]any:
				m2.Kwargs = x
			default:
				err = fmt.Errorf("plain SQS message %s: the body is neither a JSON list (positional arguments) nor an object (keyword arguments)", m.ID)
			}
		}
	}
	if err == nil {
		if k := m.Attributes["idempotency_key"]; k != "" {
			m2.Headers = map[string]any{"idempotency_key": k}
		}
		var p *celeryproto.Publishing
		if p, err = celeryproto.EncodeTask(m2, celeryproto.EncodeOptions{Protocol: 2}); err == nil {
			return &celeryproto.Delivery{ContentType: p.ContentType, ContentEncoding: p.ContentEncoding, Headers: p.Headers,
				Body: p.Body, CorrelationID: p.CorrelationID, DeliveryMode: 2, Redelivered: redelivered}, false
		}
	}
	return &celeryproto.Delivery{ContentType: "application/json", ContentEncoding: "utf-8",
		HeadersError: err, Redelivered: redelivered}, false
}

// sqsDelivery is a delivery of the SQS transport.
type sqsDelivery struct {
	t *sqsTransport
	q *sqsQueue
	m sqs.Message
	w *celeryproto.Delivery
	// kombu: a Celery message (else a plain one).
	kombu bool
	// deadline is when the message's visibility runs out, as last
	// extended (Unix nanoseconds).
	deadline atomic.Int64
	// settled: deleted or handed back; gone: stale; freed: its place in
	// the window given back; released: its FIFO group released.
	settled, gone, freed, released atomic.Bool
}

func (d *sqsDelivery) wire() *celeryproto.Delivery { return d.w }

func (d *sqsDelivery) origin() origin {
	o := origin{Queue: d.q.Name, RoutingKey: d.q.Name}
	return o
}

func (d *sqsDelivery) redelivered() bool  { return d.m.ReceiveCount > 1 }
func (d *sqsDelivery) deliveryCount() int { return max(d.m.ReceiveCount-1, 0) }
func (d *sqsDelivery) stale() bool        { return d.gone.Load() }

// deliveryLimit is 0: past a redrive policy's maxReceiveCount SQS moves
// the message to its dead-letter queue, which is this queue's quarantine:
// nothing is dropped.
func (d *sqsDelivery) deliveryLimit() int { return 0 }

// passOn is never asked of an SQS delivery (its deliveryLimit is 0).
func (d *sqsDelivery) passOn(context.Context, int) error {
	return errors.New("tasks: an SQS message has no delivery limit to pass on")
}

// groupKey is the FIFO group of the delivery's message.
func (d *sqsDelivery) groupKey() string { return d.q.Name + "\x00" + d.m.GroupID }

// drop makes the delivery stale.
func (d *sqsDelivery) drop() {
	d.gone.Store(true)
	d.finish(false)
}

// finish takes the delivery out of the extended set, gives its place in
// the window back and lets the next of its FIFO group go (once each);
// backToo: the group's waiting deliveries are handed back instead (so
// that the group keeps its order).
func (d *sqsDelivery) finish(backToo bool) {
	t := d.t
	t.mu.Lock()
	delete(t.held, d)
	var next *sqsDelivery
	var back []*sqsDelivery
	if d.q.fifo && !d.released.Swap(true) {
		k := d.groupKey()
		waiting := t.groups[k]
		switch {
		case backToo || d.gone.Load():
			back = waiting
			delete(t.groups, k)
		case len(waiting) > 0:
			next = waiting[0]
			t.groups[k] = waiting[1:]
		default:
			delete(t.groups, k)
		}
	}
	t.mu.Unlock()
	if !d.freed.Swap(true) {
		t.unreserve(1)
	}
	if next != nil {
		t.dispatch(next)
	}
	for _, b := range back {
		b.released.Store(true)
		_ = b.giveBack()
	}
}

// ack deletes the message (batched).
func (d *sqsDelivery) ack() error {
	if d.settled.Swap(true) {
		return nil
	}
	defer d.finish(false)
	if d.gone.Load() {
		return fmt.Errorf("sqs message %s: no longer in flight: %w", d.m.ID, sqs.ErrGone)
	}
	ctx, cancel := final(context.Background())
	defer cancel()
	return d.t.client.Delete(ctx, d.q.url, d.m.ReceiptHandle)
}

// giveBack makes the message visible again now, asynchronously (the caller
// may hold the worker's lock); a give-back that fails leaves the message
// to its visibility timeout.
func (d *sqsDelivery) giveBack() error {
	if d.settled.Swap(true) {
		return nil
	}
	t := d.t
	gone := d.gone.Load()
	d.finish(true)
	if gone || t.client == nil {
		return nil
	}
	t.backs.Add(1)
	go func() {
		defer t.backs.Done()
		ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
		defer cancel()
		errs := t.client.SetVisibility(ctx, []sqs.Visibility{{QueueURL: d.q.url, ReceiptHandle: d.m.ReceiptHandle}})
		if errs[0] != nil && !errors.Is(errs[0], sqs.ErrGone) {
			t.log.Warn("handing an SQS message back failed; it comes again when its visibility timeout runs out",
				zap.String("queue", d.q.Name), zap.String("message_id", d.m.ID), zap.Error(errs[0]))
		}
	}()
	return nil
}

// sqsAttr is one message attribute of a copy.
type sqsAttr struct{ name, typ, value string }

func (a sqsAttr) size() int { return sqs.AttributeSize(a.name, a.typ, a.value) }

// sqsWorkerRead are the attributes of a plain message the worker reads
// (sqsWire): a copy keeps them ahead of the producer's others.
var sqsWorkerRead = []string{"task", "task_id", "retries", "idempotency_key"}

// own is the message's attribute named k.
func (d *sqsDelivery) own(k string) sqsAttr {
	typ := d.m.AttributeTypes[k]
	if typ == "" {
		typ = "String"
	}
	return sqsAttr{name: k, typ: typ, value: d.m.Attributes[k]}
}

// ownAttrs are the message's own attributes not in skip: those the worker
// reads (sqsWorkerRead order), then the others in name order.
func (d *sqsDelivery) ownAttrs(skip map[string]bool) (read, others []sqsAttr) {
	for _, k := range sqsWorkerRead {
		if _, ok := d.m.Attributes[k]; ok && !skip[k] {
			read = append(read, d.own(k))
		}
	}
	names := make([]string, 0, len(d.m.Attributes))
	for k := range d.m.Attributes {
		if !skip[k] && !slices.Contains(sqsWorkerRead, k) {
			names = append(names, k)
		}
	}
	sort.Strings(names)
	for _, k := range names {
		others = append(others, d.own(k))
	}
	return read, others
}

// outgoing is a message of body and attrs.
func outgoing(body string, attrs []sqsAttr) sqs.Outgoing {
	m := sqs.Outgoing{Body: body}
	if len(attrs) > 0 {
		m.Attributes = make(map[string]string, len(attrs))
		m.AttributeTypes = make(map[string]string, len(attrs))
		for _, a := range attrs {
			m.Attributes[a.name] = a.value
			m.AttributeTypes[a.name] = a.typ
		}
	}
	return m
}

// copyOf is a copy of the message to its own queue, with body, ours (the
// worker's, over the message's own of the same names) and the message's
// own attributes, within SQS's ten attributes and the queue's
// MaximumMessageSize: ours and those the worker reads first, then the
// others in name order while they fit (those left out are logged). A copy
// whose first ones do not fit is refused before sending
// (*amqp.RefusedError).
func (d *sqsDelivery) copyOf(body string, ours []sqsAttr) (sqs.Outgoing, error) {
	skip := map[string]bool{}
	for _, a := range ours {
		skip[a.name] = true
	}
	read, others := d.ownAttrs(skip)
	attrs := append(append([]sqsAttr(nil), ours...), read...)
	size := len(body)
	for _, a := range attrs {
		size += a.size()
	}
	if len(attrs) > sqs.MaxAttributes || size > d.q.maxSize {
		err := fmt.Errorf("%w: a copy of message %s with the attributes the worker reads takes %d attributes and %d bytes (SQS takes %d attributes, queue %s %d bytes)",
			sqs.ErrRefused, d.m.ID, len(attrs), size, sqs.MaxAttributes, d.q.Name, d.q.maxSize)
		return sqs.Outgoing{}, sqsRefused(d.q.Name, err)
	}
	var left []string
	for _, a := range others {
		if len(attrs) >= sqs.MaxAttributes || size+a.size() > d.q.maxSize {
			left = append(left, a.name)
			continue
		}
		attrs = append(attrs, a)
		size += a.size()
	}
	if len(left) > 0 {
		d.t.log.Warn("SQS copy leaves out message attributes over SQS's limits", zap.String("queue", d.q.Name),
			zap.String("message_id", d.m.ID), zap.Strings("left_out", left), zap.Int("max_attributes", sqs.MaxAttributes),
			zap.Int("max_message_size", d.q.maxSize))
	}
	return outgoing(body, attrs), nil
}

// send sends a copy to the queue at u, named name; SQS's refusal of it
// is an *amqp.RefusedError.
func (d *sqsDelivery) send(ctx context.Context, u, name string, m sqs.Outgoing) error {
	ctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	if m.GroupID == "" {
		m.GroupID = d.m.GroupID
	}
	_, err := d.t.client.Send(ctx, u, m)
	return sqsRefused(name, err)
}

// republish sends a copy to the queue it came from, delayed until eta as
// far as SQS delays (15 minutes: a copy due later is held again when it
// comes).
func (d *sqsDelivery) republish(ctx context.Context, eta time.Time) error {
	var ours []sqsAttr
	if !d.kombu {
		ours = []sqsAttr{{"task_id", "String", d.wireID()}}
	}
	m, err := d.copyOf(d.m.Body, ours)
	if err != nil {
		return err
	}
	m.Delay = time.Until(eta)
	return d.send(ctx, d.q.url, d.q.Name, m)
}

// wireID is the task id of the delivery's message as read.
func (d *sqsDelivery) wireID() string {
	if id := d.m.Attributes["task_id"]; id != "" {
		return id
	}
	return d.m.ID
}

// retry sends next to the queue the delivery came from, delayed until its
// ETA as far as SQS delays: a Celery message as kombu writes it, a plain
// one as a plain message with its task, task id and retries as
// attributes.
func (d *sqsDelivery) retry(ctx context.Context, next *celeryproto.Message, _ *RetryRequest) error {
	var delay time.Duration
	if !next.ETA.IsZero() {
		delay = time.Until(next.ETA)
	}
	if !d.kombu {
		m, err := d.copyOf(d.m.Body, []sqsAttr{{"task", "String", next.Task}, {"task_id", "String", next.ID},
			{"retries", "String", strconv.Itoa(next.Retries)}})
		if err != nil {
			return err
		}
		m.Delay = delay
		return d.send(ctx, d.q.url, d.q.Name, m)
	}
	pub, err := celeryproto.EncodeTask(next, celeryproto.EncodeOptions{Protocol: 2, Serializer: next.Serializer()})
	if err != nil {
		return &encodeError{err}
	}
	body, err := sqs.EncodeKombu(pub, d.q.Name)
	if err != nil {
		return &encodeError{err}
	}
	if len(body) > d.q.maxSize {
		err := fmt.Errorf("%w: the retry of message %s takes %d bytes in kombu's envelope (queue %s takes %d)",
			sqs.ErrRefused, d.m.ID, len(body), d.q.Name, d.q.maxSize)
		return sqsRefused(d.q.Name, err)
	}
	return d.send(ctx, d.q.url, d.q.Name, sqs.Outgoing{Body: body, Delay: delay})
}

// minCutDetail is the shortest HeaderDetail a quarantine copy cut to fit
// keeps; shorter, it is left out.
const minCutDetail = 64

// quarantine sends a copy (the body as it came) to the queue's quarantine
// queue, ours as message attributes beside the message's own
// (quarantineCopy). A copy SQS refuses all the same goes again with the
// reason alone.
func (d *sqsDelivery) quarantine(ctx context.Context, ours map[string]any) error {
	m, cut := d.quarantineCopy(ours)
	if cut {
		d.t.log.Error("SQS quarantine copy's body cut to fit the quarantine queue's maximum message size",
			zap.String("queue", d.q.Name), zap.String("quarantine_queue", d.q.quarantineName), zap.String("message_id", d.m.ID),
			zap.Int("body_bytes", len(d.m.Body)), zap.Int("max_message_size", d.q.quarantineMax))
	}
	err := d.send(ctx, d.q.quarantine, d.q.quarantineName, m)
	if amqp.IsPermanent(err) {
		// The reason alone (and a plain message's task id), beside the
		// body: the message's own attributes could not go.
		attrs := []sqsAttr{{HeaderReason, "String", sqs.ValidTextOf(clip.String(fmt.Sprint(ours[HeaderReason]), maxQuarantineValue))}}
		if !d.kombu {
			attrs = append(attrs, sqsAttr{"task_id", "String", sqs.ValidTextOf(d.wireID())})
		}
		note := sqsAttr{HeaderTruncated, "String", sqs.ValidTextOf(clip.String("all other attributes left out: "+err.Error(), 512))}
		attrs = append(attrs, note)
		body := m.Body
		size := len(body)
		for _, a := range attrs {
			size += a.size()
		}
		if size > d.q.quarantineMax {
			body = clip.Prefix(body, max(len(body)-(size-d.q.quarantineMax), 0))
		}
		m2 := outgoing(body, attrs)
		m2.GroupID = m.GroupID
		err = d.send(ctx, d.q.quarantine, d.q.quarantineName, m2)
	}
	return err
}

// quarantineCopy is the quarantine copy of the message: its body and, at
// most sqs.MaxAttributes in all, in this order: HeaderReason, a plain
// message's task_id and task, the message's own attributes the worker
// reads (retries, idempotency_key: 'onceler quarantine requeue' sends
// them back), HeaderDetail, ours but HeaderQueue and HeaderTime, those
// two, then the message's own others in name order; those left out are
// named in HeaderTruncated. A copy over the quarantine queue's
// MaximumMessageSize is cut to fit, the body kept whole first:
// HeaderDetail shortened (or left out), then ours but HeaderReason left
// out, the message's own others (the largest first), HeaderTruncated,
// HeaderReason, and those the worker reads. A body that does not fit even
// alone is cut (cut reports it), as HeaderTruncated says.
func (d *sqsDelivery) quarantineCopy(ours map[string]any) (m sqs.Outgoing, cut bool) {
	text := func(k string, v any) sqsAttr {
		return sqsAttr{k, "String", sqs.ValidTextOf(clip.String(fmt.Sprint(v), maxQuarantineValue))}
	}
	var attrs []sqsAttr
	add := func(a sqsAttr) {
		if !slices.ContainsFunc(attrs, func(b sqsAttr) bool { return b.name == a.name }) {
			attrs = append(attrs, a)
		}
	}
	if v, ok := ours[HeaderReason]; ok {
		add(text(HeaderReason, v))
	}
	if !d.kombu {
		// A plain message's task id is its first message id: the copy's
		// differs ('onceler quarantine' names messages by it).
		add(sqsAttr{"task_id", "String", sqs.ValidTextOf(d.wireID())})
	}
	mine := func(a sqsAttr) bool { _, ok := ours[a.name]; return ok }
	read, others := d.ownAttrs(nil)
	for _, a := range read {
		if !mine(a) {
			add(a)
		}
	}
	if v, ok := ours[HeaderDetail]; ok {
		add(text(HeaderDetail, v))
	}
	rest := make([]string, 0, len(ours))
	for k := range ours {
		if k != HeaderQueue && k != HeaderTime {
			rest = append(rest, k)
		}
	}
	sort.Strings(rest)
	for _, k := range append(rest, HeaderQueue, HeaderTime) {
		if v, ok := ours[k]; ok {
			add(text(k, v))
		}
	}
	for _, a := range others {
		if !mine(a) {
			add(a)
		}
	}
	var left, shortened []string
	if len(attrs) > sqs.MaxAttributes {
		for _, a := range attrs[sqs.MaxAttributes-1:] {
			left = append(left, a.name)
		}
		attrs = attrs[:sqs.MaxAttributes-1]
	}
	body, limit := d.m.Body, d.q.quarantineMax
	note := func() string {
		var parts []string
		if len(left) > 0 {
			parts = append(parts, "left out: "+strings.Join(left, ", "))
		}
		if len(shortened) > 0 {
			parts = append(parts, "cut: "+strings.Join(shortened, ", "))
		}
		if cut {
			parts = append(parts, fmt.Sprintf("body cut to its first %d of %d bytes", len(body), len(d.m.Body)))
		}
		return sqs.ValidTextOf(clip.String(strings.Join(parts, "; "), 256))
	}
	drop := func(i int) {
		left = append(left, attrs[i].name)
		attrs = slices.Delete(attrs, i, i+1)
	}
	index := func(match func(sqsAttr) bool) int { return slices.IndexFunc(attrs, match) }
	noNote := false
	for {
		n := ""
		if !noNote {
			n = note()
		}
		if n != "" && len(attrs) >= sqs.MaxAttributes {
			// Room for the note among the ten.
			drop(len(attrs) - 1)
			continue
		}
		size := len(body)
		for _, a := range attrs {
			size += a.size()
		}
		if n != "" {
			size += sqs.AttributeSize(HeaderTruncated, "String", n)
		}
		excess := size - limit
		if excess <= 0 {
			break
		}
		// The note grows by a name or two with each cut: room for it.
		const slack = 64
		detail := index(func(a sqsAttr) bool { return a.name == HeaderDetail })
		ourLast := -1
		for i, a := range attrs {
			if mine(a) && a.name != HeaderReason && a.name != HeaderDetail {
				ourLast = i
			}
		}
		ownOther := largest(attrs, func(a sqsAttr) bool { return !mine(a) && !slices.Contains(sqsWorkerRead, a.name) })
		reason := index(func(a sqsAttr) bool { return a.name == HeaderReason })
		readAttr := -1
		for _, k := range []string{"retries", "idempotency_key", "task", "task_id"} {
			if readAttr = index(func(a sqsAttr) bool { return a.name == k }); readAttr >= 0 {
				break
			}
		}
		switch {
		case detail >= 0:
			if keep := len(attrs[detail].value) - excess - slack; keep >= minCutDetail {
				attrs[detail].value = clip.Prefix(attrs[detail].value, keep)
				if !slices.Contains(shortened, HeaderDetail) {
					shortened = append(shortened, HeaderDetail)
				}
			} else {
				drop(detail)
			}
		case ourLast >= 0:
			drop(ourLast)
		case ownOther >= 0:
			drop(ownOther)
		case n != "" && !cut:
			noNote = true
		case reason >= 0:
			drop(reason)
		case readAttr >= 0:
			drop(readAttr)
		case len(body) > 0:
			// The body alone does not fit: cut, and said so.
			body = clip.Prefix(body, max(len(body)-excess-slack, 0))
			cut, noNote = true, false
		default:
			// Nothing left to cut: sent as it is, for SQS to answer.
			noNote = true
		}
		if noNote && len(body) == 0 && len(attrs) == 0 {
			break
		}
	}
	if !noNote {
		if n := note(); n != "" {
			attrs = append(attrs, sqsAttr{HeaderTruncated, "String", n})
		}
	}
	return outgoing(body, attrs), cut
}

// largest is the index of the largest of attrs that match, -1 when none
// does.
func largest(attrs []sqsAttr, match func(sqsAttr) bool) int {
	best := -1
	for i, a := range attrs {
		if match(a) && (best < 0 || a.size() > attrs[best].size()) {
			best = i
		}
	}
	return best
}

// keep: a held record keeps the message's queue, body and attributes
// with their data types, a Binary attribute's bytes as they are
// (DecodeHeldSQS).
func (d *sqsDelivery) keep() ([]byte, error) {
	h := heldSQS{Queue: d.q.Name, Body: d.m.Body, CapturedAt: time.Now().UTC()}
	for k, v := range d.m.Attributes {
		typ := d.own(k).typ
		if sqs.IsBinary(typ) {
			if h.Binary == nil {
				h.Binary = map[string][]byte{}
			}
			h.Binary[k] = []byte(v)
		} else {
			if h.Attributes == nil {
				h.Attributes = map[string]string{}
			}
			h.Attributes[k] = v
		}
		if typ != "String" {
			if h.Types == nil {
				h.Types = map[string]string{}
			}
			h.Types[k] = typ
		}
	}
	b, err := json.Marshal(h)
	if err != nil {
		return nil, fmt.Errorf("encode held SQS message: %w", err)
	}
	return b, nil
}

// heldSQS is the form of an SQS message kept in a held record: String and
// Number attributes as text, Binary ones as bytes (base64 in JSON), the
// data type of each that is not "String".
type heldSQS struct {
	Queue      string            `json:"sqs_queue"`
	Body       string            `json:"sqs_body"`
	Attributes map[string]string `json:"sqs_attributes,omitempty"`
	Binary     map[string][]byte `json:"sqs_binary_attributes,omitempty"`
	Types      map[string]string `json:"sqs_attribute_types,omitempty"`
	CapturedAt time.Time         `json:"captured_at"`
}

// DecodeHeldSQS reads the message kept in a held record of an SQS message
// (idempotency Record.Message): its queue, and the message (body,
// attributes and their data types) to send it again. ok is false for a
// record that keeps another form or nothing.
func DecodeHeldSQS(b []byte) (queue string, m sqs.Outgoing, ok bool) {
	var h heldSQS
	if !bytes.Contains(b, []byte(`"sqs_queue"`)) || json.Unmarshal(b, &h) != nil || h.Queue == "" {
		return "", sqs.Outgoing{}, false
	}
	m = sqs.Outgoing{Body: h.Body, Attributes: h.Attributes, AttributeTypes: h.Types}
	for k, v := range h.Binary {
		if m.Attributes == nil {
			m.Attributes = map[string]string{}
		}
		m.Attributes[k] = string(v)
		if !sqs.IsBinary(m.AttributeType(k)) {
			if m.AttributeTypes == nil {
				m.AttributeTypes = map[string]string{}
			}
			m.AttributeTypes[k] = "Binary"
		}
	}
	return h.Queue, m, true
}

// stepSender is a transport that sends workflow steps itself (SQS: to the
// step's queue) rather than through RabbitMQ.
type stepSender interface {
	sendStep(ctx context.Context, queue string, p *celeryproto.Publishing) error
}

var (
	_ transport  = (*sqsTransport)(nil)
	_ delivery   = (*sqsDelivery)(nil)
	_ stepSender = (*sqsTransport)(nil)
)
