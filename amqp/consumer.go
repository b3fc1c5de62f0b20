package amqp

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"go.uber.org/zap"
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

	// mu guards the fields below and serializes RPCs (basic.qos) on the live
	// channel, since amqp091 does not allow concurrent RPCs on one channel.
	mu       sync.Mutex
	prefetch int
	cur      *channelState
	global   bool

	gen     atomic.Uint64
	ready   atomic.Bool
	running atomic.Bool
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
	return &Consumer{cfg: cfg, cc: cc, log: cfg.Logger.Named("amqp.consumer"), prefetch: cc.Prefetch}
}

// Ready reports whether the consumer is consuming now: connected, topology
// declared, QoS set and basic.consume accepted.
func (c *Consumer) Ready() bool { return c.ready.Load() }

// Prefetch returns the prefetch count in force (or to apply on reconnect).
func (c *Consumer) Prefetch() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.prefetch
}

// SetPrefetch changes the prefetch count: at once on the live channel, and
// on every reconnect after. For quorum queues RabbitMQ applies per-consumer
// prefetch only to consumers started after the change, so there the new
// value takes effect at the next reconnect.
func (c *Consumer) SetPrefetch(n int) error {
	if n < 0 || n > 65535 {
		return fmt.Errorf("%w: prefetch %d outside 0..65535", ErrConfig, n)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.prefetch = n
	st := c.cur
	if st == nil || st.dead() {
		return nil
	}
	if err := st.ch.Qos(n, 0, c.global); err != nil {
		if st.dead() {
			return nil // applied on reconnect
		}
		return fmt.Errorf("set prefetch %d: %w", n, err)
	}
	return nil
}

// Run consumes until ctx is done, calling handle for each delivery on Run's
// goroutine; handle must return quickly (hand the delivery to a pool). After
// a connection or channel loss, deliveries already handed out become stale
// and Run reconnects with jittered backoff, declares the queues, restores
// QoS and consumes again. Run returns nil once ctx is done (after the drain
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
		established, err := c.session(ctx, handle)
		if ctx.Err() != nil {
			return nil
		}
		if IsTopologyError(err) {
			c.log.Error("consumer topology refused by the broker", zap.Error(err))
			return err
		}
		if established {
			b.reset()
		}
		wait := b.next()
		c.log.Warn("consumer disconnected; reconnecting", zap.Error(err), zap.Duration("backoff", wait))
		if !sleep(ctx, wait) {
			return nil
		}
	}
}

// session is one connection's life. established reports whether consuming
// started, which resets the backoff.
func (c *Consumer) session(ctx context.Context, handle func(*Delivery)) (established bool, err error) {
	conn, err := c.cfg.dial(ctx, "consume")
	if err != nil {
		return false, err
	}
	st := &channelState{gen: c.gen.Add(1)}
	var wg sync.WaitGroup
	stop := make(chan struct{})
	defer func() {
		// Order matters: mark the channel dead before closing it, so that
		// an Ack racing with the close reports ErrStaleDelivery.
		st.closed.Store(true)
		c.ready.Store(false)
		c.mu.Lock()
		if c.cur == st {
			c.cur = nil
		}
		c.mu.Unlock()
		close(stop)
		_ = conn.Close()
		wg.Wait()
	}()
	connClosed := conn.NotifyClose(make(chan *amqp091.Error, 1))
	ch, err := conn.Channel()
	if err != nil {
		return false, fmt.Errorf("open channel: %w", err)
	}
	st.ch = ch
	chClosed := ch.NotifyClose(make(chan *amqp091.Error, 1))
	cancels := ch.NotifyCancel(make(chan string, len(c.cc.Queues)+1))

	global := true
	for _, q := range c.cc.Queues {
		if q.Quorum {
			global = false
		}
		if err := declare(ch, q); err != nil {
			return false, err
		}
	}
	c.mu.Lock()
	prefetch := c.prefetch
	c.mu.Unlock()
	if err := ch.Qos(prefetch, 0, global); err != nil {
		return false, fmt.Errorf("set prefetch %d: %w", prefetch, err)
	}

	queueOf := make(map[string]string, len(c.cc.Queues))
	ins := make([]<-chan amqp091.Delivery, 0, len(c.cc.Queues))
	for i, q := range c.cc.Queues {
		tag := fmt.Sprintf("%s/%d/%d", c.cc.Tag, st.gen, i)
		dch, err := ch.Consume(q.Name, tag, false, false, false, false, nil)
		if err != nil {
			return false, fmt.Errorf("consume %q: %w", q.Name, err)
		}
		queueOf[tag] = q.Name
		ins = append(ins, dch)
	}
	in := merge(ins, stop, &wg)

	c.mu.Lock()
	c.cur, c.global = st, global
	// A SetPrefetch between the Qos above and now is applied here.
	if c.prefetch != prefetch {
		prefetch = c.prefetch
		if err := ch.Qos(prefetch, 0, global); err != nil {
			c.mu.Unlock()
			return false, fmt.Errorf("set prefetch %d: %w", prefetch, err)
		}
	}
	c.mu.Unlock()
	c.ready.Store(true)
	c.log.Info("consuming", zap.Strings("queues", queueNames(c.cc.Queues)),
		zap.Int("prefetch", prefetch), zap.Bool("global_qos", global), zap.Uint64("channel_generation", st.gen))

	for {
		select {
		case <-ctx.Done():
			c.drain(st, in, queueOf, chClosed, connClosed)
			return true, nil
		case m, ok := <-in:
			if !ok {
				return true, closeReason(chClosed, connClosed)
			}
			st.outstanding.Add(1)
			handle(newDelivery(&m, queueOf[m.ConsumerTag], st))
		case e := <-chClosed:
			return true, fmt.Errorf("channel closed: %w", errOrClosed(e))
		case e := <-connClosed:
			return true, fmt.Errorf("connection closed: %w", errOrClosed(e))
		case tag := <-cancels:
			return true, fmt.Errorf("%w: consumer %s of queue %q", ErrCancelled, tag, queueOf[tag])
		}
	}
}

// drain stops consuming and waits, up to DrainTimeout, for the deliveries
// handed out to be settled. What arrives meanwhile goes back to the queue.
func (c *Consumer) drain(st *channelState, in <-chan amqp091.Delivery, queueOf map[string]string,
	chClosed, connClosed <-chan *amqp091.Error) {
	c.ready.Store(false)
	c.mu.Lock()
	c.cur = nil // no basic.qos from SetPrefetch while the cancels run
	c.mu.Unlock()
	if c.cc.DrainTimeout <= 0 {
		return
	}
	cancelled := make(chan struct{})
	go func() {
		defer close(cancelled)
		for tag := range queueOf {
			if err := st.ch.Cancel(tag, false); err != nil {
				c.log.Debug("cancel consumer", zap.String("tag", tag), zap.Error(err))
			}
		}
	}()
	defer func() { <-cancelled }()
	timer := time.NewTimer(c.cc.DrainTimeout)
	defer timer.Stop()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	c.log.Info("draining: consumers cancelled, waiting for handed-out deliveries",
		zap.Int64("outstanding", st.outstanding.Load()), zap.Duration("timeout", c.cc.DrainTimeout))
	for {
		select {
		case m, ok := <-in:
			if !ok {
				in = nil
				continue
			}
			if err := m.Nack(false, true); err != nil {
				c.log.Debug("requeue after cancel", zap.Error(err))
			}
		case <-tick.C:
			if st.outstanding.Load() <= 0 {
				return
			}
		case <-timer.C:
			c.log.Warn("drain timeout: closing with deliveries unsettled; the broker redelivers them",
				zap.Int64("outstanding", st.outstanding.Load()))
			return
		case <-chClosed:
			return
		case <-connClosed:
			return
		}
	}
}

// merge fans several delivery channels into one. A single channel is used
// as it is.
func merge(ins []<-chan amqp091.Delivery, stop <-chan struct{}, wg *sync.WaitGroup) <-chan amqp091.Delivery {
	if len(ins) == 1 {
		return ins[0]
	}
	out := make(chan amqp091.Delivery)
	var fw sync.WaitGroup
	for _, in := range ins {
		fw.Add(1)
		go func() {
			defer fw.Done()
			for m := range in {
				select {
				case out <- m:
				case <-stop:
					return
				}
			}
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		fw.Wait()
		close(out)
	}()
	return out
}

func closeReason(chClosed, connClosed <-chan *amqp091.Error) error {
	t := time.NewTimer(100 * time.Millisecond)
	defer t.Stop()
	select {
	case e := <-chClosed:
		return fmt.Errorf("channel closed: %w", errOrClosed(e))
	case e := <-connClosed:
		return fmt.Errorf("connection closed: %w", errOrClosed(e))
	case <-t.C:
		return errors.New("amqp: delivery stream ended")
	}
}

func errOrClosed(e *amqp091.Error) error {
	if e == nil {
		return amqp091.ErrClosed
	}
	return e
}

func queueNames(qs []QueueSpec) []string {
	out := make([]string, len(qs))
	for i, q := range qs {
		out[i] = q.Name
	}
	return out
}
