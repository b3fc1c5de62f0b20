package amqp

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	amqp091 "github.com/onceler/onceler/internal/amqp091"
	"github.com/onceler/onceler/internal/pause"
)

// DefaultPrefetch is the prefetch count used when ConsumerConfig.Prefetch is 0.
const DefaultPrefetch = 64

// ConsumerConfig says what a Consumer consumes.
type ConsumerConfig struct {
	// Queues are declared (or checked, when passive) on every connect, then
	// consumed from one channel.
	Queues []QueueSpec
	// Prefetch is the initial basic.qos prefetch count, 1..65535; default
	// DefaultPrefetch. It is per channel (global) for classic queues and per
	// consumer when any queue is a quorum queue, which has no global QoS.
	Prefetch int
	// Tag prefixes the consumer tags; default Config.Name.
	Tag string
	// DrainTimeout is how long Run keeps the channel open after its context
	// ends, so that deliveries already handed out can still be acknowledged.
	// Run first cancels the consumers and requeues whatever arrives after
	// that, then waits until every handed-out delivery is settled or
	// DrainTimeout passes, then closes. 0 closes at once: unsettled
	// deliveries are then redelivered by the broker.
	DrainTimeout time.Duration
}

// Consumer consumes from a set of queues over a connection of its own,
// reconnecting and re-declaring after any loss. Create it with NewConsumer
// and call Run once.
type Consumer struct {
	cfg Config
	cc  ConsumerConfig
	log *zap.Logger
	ep  *failover

	// mu guards the fields below and serializes RPCs (basic.qos) on the live
	// channel, since amqp091 does not allow concurrent RPCs on one channel.
	mu       sync.Mutex
	prefetch int // in force: min(requested, limit)
	cur      *channelState
	global   bool
	// requested is the count SetPrefetch asked for; limit, when not 0,
	// caps it (SetWindowLimit: flow control).
	requested, limit int

	// found holds the queues as found on the last connect (nil before);
	// notes, the last logged description of each.
	found []queueState
	notes []string
	// added names the queues added at run time (AddQueue): one the broker
	// refuses on a reconnect is dropped, not an end of the consumer.
	added map[string]bool

	// qosChanged asks the consume goroutine to restart per-consumer
	// prefetch consumers (quorum queues) under the new limit.
	qosChanged chan struct{}
	// topo asks the consume goroutine to apply a change of the queues
	// (AddQueue, CancelQueue).
	topo chan topoReq

	gen     atomic.Uint64
	ready   atomic.Bool
	running atomic.Bool
	// reconnects counts the sessions lost and started again.
	reconnects atomic.Int64
}

// NewConsumer returns a Consumer; nothing happens until Run.
func NewConsumer(cfg Config, cc ConsumerConfig) *Consumer {
	cfg = cfg.withDefaults()
	if cc.Prefetch == 0 {
		cc.Prefetch = DefaultPrefetch
	}
	if cc.Tag == "" {
		cc.Tag = cfg.Name
	}
	cc.Queues = append([]QueueSpec(nil), cc.Queues...)
	log := cfg.Logger.Named("amqp.consumer")
	return &Consumer{
		cfg: cfg, cc: cc, log: log, ep: newFailover(cfg, log),
		prefetch: cc.Prefetch, requested: cc.Prefetch, qosChanged: make(chan struct{}, 1), topo: make(chan topoReq),
	}
}

// Ready reports whether the consumer is consuming now: connected, topology
// declared, QoS set and basic.consume accepted.
func (c *Consumer) Ready() bool { return c.ready.Load() }

// Queues returns the consumed queues as found on the broker at the last
// connect: a queue that existed with the flags and arguments the broker
// holds for it, a queue declared here with those it was declared with.
// Before the first connect, and for a passive spec or a queue whose
// arguments the broker would not tell (see "Queues" in the package
// documentation), the configured spec.
func (c *Consumer) Queues() []QueueSpec {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]QueueSpec, len(c.cc.Queues))
	for i, q := range c.cc.Queues {
		out[i] = q
		if i < len(c.found) {
			out[i] = c.found[i].spec
		}
	}
	return out
}

// ensureQueues makes sure every queue exists, on side channels of conn
// (a refused declare closes its channel), and returns them as found. A
// queue added at run time that the broker refuses is dropped from the
// configuration, with an error log.
func (c *Consumer) ensureQueues(conn *amqp091.Connection) ([]QueueSpec, error) {
	c.mu.Lock()
	prev := c.found
	queues := slices.Clone(c.cc.Queues)
	added := maps.Clone(c.added)
	c.mu.Unlock()
	sc := &scratch{conn: conn}
	defer sc.close()
	states := make([]queueState, 0, len(queues))
	specs := make([]QueueSpec, 0, len(queues))
	kept := make([]QueueSpec, 0, len(queues))
	var dropped []string
	for i, q := range queues {
		var last *QueueSpec
		if i < len(prev) && prev[i].learned {
			last = &prev[i].spec
		}
		st, err := ensure(sc, q, last)
		if err != nil && added[q.Name] && refusedAdded(err) {
			c.log.Error("queue added at run time refused by the broker on reconnect: no longer consumed",
				zap.String("queue", q.Name), zap.Error(err))
			dropped = append(dropped, q.Name)
			if conn.IsClosed() {
				c.dropQueues(dropped)
				return nil, fmt.Errorf("declare %s: %w", q.Name, err)
			}
			continue
		}
		if err != nil {
			return nil, err
		}
		states, specs, kept = append(states, st), append(specs, st.spec), append(kept, q)
	}
	c.mu.Lock()
	for _, name := range dropped {
		c.removeQueueLocked(name)
	}
	c.found = states
	c.mu.Unlock()
	c.noteQueues(states, kept)
	return specs, nil
}

// dropQueues drops the queues named from the configuration.
func (c *Consumer) dropQueues(names []string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, name := range names {
		c.removeQueueLocked(name)
	}
}

// noteQueues logs how each queue was found, when it changed since the last
// connect.
func (c *Consumer) noteQueues(states []queueState, queues []QueueSpec) {
	if len(c.notes) != len(states) {
		c.notes = make([]string, len(states))
	}
	for i, st := range states {
		q, conf := st.spec, queues[i]
		fields := []zap.Field{zap.String("queue", q.Name), zap.Any("arguments", q.Args),
			zap.Bool("durable", q.Durable), zap.Bool("auto_delete", q.AutoDelete)}
		level, msg := zapcore.InfoLevel, "queue exists; served as declared"
		switch {
		case conf.Passive:
			level, msg = zapcore.DebugLevel, "queue checked (passive)"
		case st.created:
			msg = "queue declared"
		case st.unlearned != nil:
			level, msg = zapcore.WarnLevel, "queue exists, but the broker does not tell its arguments; served as it is, taken to have the configured ones"
			fields = append(fields, zap.Error(st.unlearned))
		case st.differs && (len(conf.Args) > 0 || conf.Quorum):
			level, msg = zapcore.WarnLevel, "queue exists with other arguments than configured for it (those apply only to a missing queue); served as declared"
			fields = append(fields, zap.Any("configured_arguments", conf.declaredArgs()))
		}
		note := fmt.Sprint(msg, q.Args, q.Durable, q.AutoDelete, st.unlearned)
		if note == c.notes[i] {
			level = zapcore.DebugLevel
		}
		c.notes[i] = note
		if ce := c.log.Check(level, msg); ce != nil {
			ce.Write(fields...)
		}
	}
}

// Prefetch returns the prefetch count in force (or to apply on reconnect).
func (c *Consumer) Prefetch() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.prefetch
}

// SetPrefetch changes the prefetch count: on the live channel, and on every
// reconnect after. It may be called from the handler. On classic queues the
// channel's global basic.qos changes at once. RabbitMQ applies per-consumer
// prefetch (quorum queues) only to consumers started after the change, so
// there the consume goroutine restarts each consumer under the new limit;
// until the deliveries of the replaced consumers are settled, the window is
// the new limit plus those.
func (c *Consumer) SetPrefetch(n int) error {
	if n < 0 || n > 65535 {
		return fmt.Errorf("%w: prefetch %d outside 0..65535", ErrConfig, n)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.requested = n
	return c.applyLocked()
}

// SetWindowLimit caps the prefetch count at n (flow control: a worker
// short of memory lets fewer deliveries in, and with n at or below the
// deliveries it holds, none until it settles some); 0 removes the cap. The
// prefetch in force is the smaller of the two, applied as SetPrefetch
// applies it.
func (c *Consumer) SetWindowLimit(n int) error {
	if n < 0 || n > 65535 {
		return fmt.Errorf("%w: window limit %d outside 0..65535", ErrConfig, n)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.limit = n
	return c.applyLocked()
}

// applyLocked applies min(requested, limit); c.mu is held.
func (c *Consumer) applyLocked() error {
	n := c.requested
	if c.limit > 0 && (n == 0 || c.limit < n) {
		n = c.limit
	}
	if n == c.prefetch {
		return nil
	}
	c.prefetch = n
	st := c.cur
	if st == nil || st.dead() {
		return nil // applied on (re)connect
	}
	if !c.global {
		select {
		case c.qosChanged <- struct{}{}:
		default: // a change is already pending; it reads the latest value
		}
		return nil
	}
	if err := st.ch.Qos(n, 0, true); err != nil {
		if st.dead() {
			return nil
		}
		return fmt.Errorf("set prefetch %d: %w", n, err)
	}
	return nil
}

// Run consumes until ctx is done, calling handle for each delivery on Run's
// goroutine; handle must return quickly (hand the delivery to a pool). After
// a connection or channel loss, deliveries already handed out become stale
// and Run reconnects with jittered backoff, declares the queues, restores
// QoS and consumes again; the backoff resets only after a session that
// consumed for at least Config.MaxBackoff, so a loss that repeats as soon as
// consuming starts waits longer each time. Run returns nil once ctx is done (after the drain
// described at ConsumerConfig.DrainTimeout), and an error only for what
// retrying cannot cure (IsTopologyError): a declare refused with 406, a
// passive declare of a missing queue, a refused access, a bad Config.
func (c *Consumer) Run(ctx context.Context, handle func(*Delivery)) error {
	if len(c.cc.Queues) == 0 {
		return fmt.Errorf("%w: consumer without queues", ErrConfig)
	}
	if c.cc.Prefetch < 0 || c.cc.Prefetch > 65535 {
		return fmt.Errorf("%w: prefetch %d outside 0..65535", ErrConfig, c.cc.Prefetch)
	}
	if !c.running.CompareAndSwap(false, true) {
		return errors.New("amqp: Consumer.Run called while already running")
	}
	defer c.running.Store(false)
	b := backoff{min: c.cfg.MinBackoff, max: c.cfg.MaxBackoff}
	for {
		consumed, err := c.session(ctx, handle)
		if ctx.Err() != nil {
			return nil
		}
		if IsTopologyError(err) {
			c.log.Error("consumer topology refused by the broker", zap.Error(err))
			return err
		}
		if healthy(consumed, c.cfg.MaxBackoff) {
			b.reset()
		}
		wait := b.next()
		c.reconnects.Add(1)
		if errors.Is(err, ErrConsumerTimeout) {
			c.log.Warn(consumerTimeoutWarning, zap.Error(err), zap.Duration("consumed_for", consumed),
				zap.Int("failures_in_a_row", b.attempt), zap.Duration("backoff", wait))
		} else {
			c.log.Warn("consumer disconnected; reconnecting", zap.Error(err), zap.Duration("consumed_for", consumed),
				zap.Int("failures_in_a_row", b.attempt), zap.Duration("backoff", wait))
		}
		if !pause.For(ctx, wait) {
			return nil
		}
	}
}

// consumerTimeoutWarning is logged when the broker closed the channel at
// its consumer_timeout (ErrConsumerTimeout).
const consumerTimeoutWarning = "consumer_timeout: the broker closed the channel because a delivery stayed unacknowledged " +
	"longer than RabbitMQ's consumer_timeout; every delivery unacknowledged on it goes back to the queue and is delivered again. " +
	"Raise consumer_timeout (rabbitmq.conf, milliseconds) above the longest a task runs plus the time a delivery waits " +
	"in the worker before it (or is held for its ETA), or make the task shorter; reconnecting"

// healthy reports whether a session that consumed for d (0 if it never
// started consuming) resets the backoff: it must have lasted at least
// maxBackoff. A session lost sooner, such as one that a message or a
// broker refusal ends each time it starts, counts as one more failure in a
// row, and the wait before the next grows up to maxBackoff instead of
// hammering the broker at the shortest backoff.
func healthy(d, maxBackoff time.Duration) bool { return d >= maxBackoff }
