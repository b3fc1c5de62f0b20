package amqp

import (
	"context"
	"fmt"
	"sync"
	"time"

	"go.uber.org/zap"

	amqp091 "github.com/onceler/onceler/internal/amqp091"
)

// tagged is a delivery with the queue its consumer reads.
type tagged struct {
	m      amqp091.Delivery
	queue  string
	quorum bool
	limit  int // the queue's delivery limit, 0 if none
}

// consumeSession is one connection's consumers, owned by Run's goroutine.
type consumeSession struct {
	c      *Consumer
	conn   *amqp091.Connection
	st     *channelState
	global bool
	// applied is the prefetch the current consumers were started under.
	applied int
	// queues are the queues as found on this connection.
	queues []QueueSpec
	seq    int
	tags   map[string]string // live consumer tag -> queue
	merged chan tagged
	stop   chan struct{}
	wg     sync.WaitGroup
}

// session is one connection's life. consumed is how long it consumed, 0
// if consuming never started; a long enough session resets the backoff.
func (c *Consumer) session(ctx context.Context, handle func(*Delivery)) (consumed time.Duration, err error) {
	conn, ep, err := c.ep.dial(ctx, "consume")
	if err != nil {
		return 0, err
	}
	defer func() {
		if err != nil && ctx.Err() == nil {
			c.ep.failed(ep) // the next session goes to the next URL
		}
	}()
	s := &consumeSession{
		c: c, conn: conn, st: &channelState{gen: c.gen.Add(1)},
		tags: map[string]string{}, merged: make(chan tagged), stop: make(chan struct{}),
	}
	defer s.close()
	connClosed := conn.NotifyClose(make(chan *amqp091.Error, 1))
	if s.queues, err = c.ensureQueues(conn); err != nil {
		return 0, err
	}
	ch, err := conn.Channel()
	if err != nil {
		return 0, fmt.Errorf("open channel: %w", err)
	}
	s.st.ch = ch
	chClosed := ch.NotifyClose(make(chan *amqp091.Error, 1))
	// Each consumer is cancelled by the broker at most once; restarts for a
	// prefetch change add consumers, so leave room.
	cancels := ch.NotifyCancel(make(chan string, 4*len(s.queues)+64))

	c.mu.Lock()
	found := c.found
	s.global = true
	for i, q := range s.queues {
		// Quorum queues refuse global QoS; so may a queue whose type the
		// broker would not tell (its answer cut short, no configure right),
		// while every queue type takes a per-consumer prefetch.
		known := i < len(found) && (found[i].learned || found[i].created)
		if q.isQuorum() || !known {
			s.global = false
		}
	}
	err = s.startConsumers()
	if err == nil {
		c.cur, c.global = s.st, s.global
	}
	c.mu.Unlock()
	if err != nil {
		return 0, err
	}
	c.ready.Store(true)
	started := time.Now()
	c.log.Info("consuming", zap.String("broker", c.ep.shown(ep)), zap.Strings("queues", queueNames(s.queues)),
		zap.Int("prefetch", s.applied), zap.Bool("global_qos", s.global), zap.Uint64("channel_generation", s.st.gen))

	for {
		select {
		case <-ctx.Done():
			s.drain(chClosed, connClosed)
			return time.Since(started), nil
		case t := <-s.merged:
			s.st.outstanding.Add(1)
			d := newDelivery(&t.m, t.queue, t.quorum, s.st)
			d.DeliveryLimit = t.limit
			handle(d)
		case req := <-c.topo:
			req.done <- s.syncQueues()
		case <-c.qosChanged:
			if err := s.restartConsumers(); err != nil {
				return time.Since(started), err
			}
		case e := <-chClosed:
			if isConsumerTimeout(e) {
				return time.Since(started), fmt.Errorf("channel closed: %w: %w", ErrConsumerTimeout, e)
			}
			return time.Since(started), fmt.Errorf("channel closed: %w", errOrClosed(e))
		case e := <-connClosed:
			return time.Since(started), fmt.Errorf("connection closed: %w", errOrClosed(e))
		case tag := <-cancels:
			if _, live := s.tags[tag]; live {
				return time.Since(started), fmt.Errorf("%w: consumer %s of queue %q", ErrCancelled, tag, s.tags[tag])
			}
		}
	}
}

// close marks the channel dead before closing it, so that an Ack racing
// with the close reports ErrStaleDelivery, then waits for the forwarders.
func (s *consumeSession) close() {
	s.st.acks.flush()
	s.st.closed.Store(true)
	s.c.ready.Store(false)
	s.c.mu.Lock()
	if s.c.cur == s.st {
		s.c.cur = nil
	}
	s.c.mu.Unlock()
	close(s.stop)
	_ = s.conn.Close()
	s.wg.Wait()
}

// startConsumers sets basic.qos and starts one consumer per queue. The
// caller holds c.mu (no other RPC runs on the channel meanwhile).
func (s *consumeSession) startConsumers() error {
	n := s.c.prefetch
	if err := s.st.ch.Qos(n, 0, s.global); err != nil {
		return fmt.Errorf("set prefetch %d: %w", n, err)
	}
	s.applied = n
	s.st.acks.setWindow(n)
	for _, q := range s.queues {
		s.seq++
		tag := fmt.Sprintf("%s/%d/%d", s.c.cc.Tag, s.st.gen, s.seq)
		dch, err := s.st.ch.Consume(q.Name, tag, false, false, false, false, nil)
		if err != nil {
			// A configured queue the user may not read stops the consumer
			// (IsTopologyError); one added at run time is as before.
			if ae := AccessRefusal("consume", err); ae != nil && !s.c.added[q.Name] {
				return ae
			}
			return fmt.Errorf("consume %q: %w", q.Name, err)
		}
		s.tags[tag] = q.Name
		s.forward(dch, q.Name, q.isQuorum(), q.DeliveryLimit())
	}
	return nil
}

// restartConsumers applies a new per-consumer prefetch: new consumers start
// under it, then the old ones are cancelled. Deliveries the old consumers
// already received stay valid (tags belong to the channel) and are still
// handed out, since amqp091 flushes a cancelled consumer's buffer.
func (s *consumeSession) restartConsumers() error {
	s.c.mu.Lock()
	defer s.c.mu.Unlock()
	if s.c.prefetch == s.applied {
		return nil
	}
	old := s.tags
	s.tags = map[string]string{}
	if err := s.startConsumers(); err != nil {
		return err
	}
	for tag := range old {
		if err := s.st.ch.Cancel(tag, false); err != nil {
			return fmt.Errorf("cancel consumer %s: %w", tag, err)
		}
	}
	s.c.log.Debug("consumers restarted under a new prefetch", zap.Int("prefetch", s.applied))
	return nil
}

// forward copies one consumer's deliveries into merged until the consumer
// ends (cancel or channel close) or the session stops.
func (s *consumeSession) forward(dch <-chan amqp091.Delivery, queue string, quorum bool, limit int) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for m := range dch {
			select {
			case s.merged <- tagged{m: m, queue: queue, quorum: quorum, limit: limit}:
			case <-s.stop:
				return
			}
		}
	}()
}

// drain stops consuming and waits, up to DrainTimeout, for the deliveries
// handed out to be settled. What arrives meanwhile goes back to the queue.
func (s *consumeSession) drain(chClosed, connClosed <-chan *amqp091.Error) {
	c := s.c
	c.ready.Store(false)
	c.mu.Lock()
	c.cur = nil // no RPC from SetPrefetch while the cancels run
	c.mu.Unlock()
	if c.cc.DrainTimeout <= 0 {
		return
	}
	cancelled := make(chan struct{})
	go func() {
		defer close(cancelled)
		for tag := range s.tags {
			if err := s.st.ch.Cancel(tag, false); err != nil {
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
		zap.Int64("outstanding", s.st.outstanding.Load()), zap.Duration("timeout", c.cc.DrainTimeout))
	for {
		select {
		case t := <-s.merged:
			if err := t.m.Nack(false, true); err != nil {
				c.log.Debug("requeue after cancel", zap.Error(err))
			} else {
				s.st.acks.settledElsewhere(t.m.DeliveryTag)
			}
		case <-tick.C:
			if s.st.outstanding.Load() <= 0 {
				return
			}
		case <-timer.C:
			c.log.Warn("drain timeout: closing with deliveries unsettled; the broker redelivers them",
				zap.Int64("outstanding", s.st.outstanding.Load()))
			return
		case <-chClosed:
			return
		case <-connClosed:
			return
		}
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
