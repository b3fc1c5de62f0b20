package amqp

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"go.uber.org/zap"

	amqp091 "github.com/onceler/onceler/internal/amqp091"
)

// Queues added and cancelled while the consumer runs (Celery's
// add_consumer and cancel_consumer remote commands).

// topoReq asks the session to consume the queues of the configuration now
// and to stop consuming the others; done gets the outcome.
type topoReq struct{ done chan error }

// topoWait bounds how long AddQueue and CancelQueue wait for the session to
// apply a change; without a session (connecting) the change applies on
// connect.
const topoWait = 10 * time.Second

// ErrNotConsuming is AddQueue's answer while the consumer is between
// connections: the queue was not added, and may be asked for again.
var ErrNotConsuming = errors.New("amqp: the consumer is not consuming now (connecting)")

// AddQueue starts consuming q: it is declared (or checked, when passive) as
// a configured queue is, and consumed, now and on every reconnect. The
// declare runs first on a connection of its own, so that a refusal, even
// one that closes a connection (an unknown exchange type), never touches
// the consuming connection and its deliveries; it is returned, and the
// queue is left out. A quorum queue, or one whose type the broker would not
// tell, has the consumer's channel move from global to per-consumer
// prefetch. While the consumer is between connections the queue is not
// added (ErrNotConsuming). A queue consumed already is left as it is. A
// queue added here that the broker refuses on a reconnect is dropped, with
// an error log; the consumer goes on with the others.
func (c *Consumer) AddQueue(q QueueSpec) error {
	if q.Name == "" {
		return fmt.Errorf("%w: queue spec without a name", ErrConfig)
	}
	c.mu.Lock()
	has := slices.ContainsFunc(c.cc.Queues, func(h QueueSpec) bool { return h.Name == q.Name })
	c.mu.Unlock()
	if has {
		return nil
	}
	st, err := c.probe(q)
	if err != nil {
		return fmt.Errorf("consume %s: %w", q.Name, err)
	}
	if !c.ready.Load() {
		return fmt.Errorf("consume %s: %w; the queue could not be added now, ask again", q.Name, ErrNotConsuming)
	}
	c.mu.Lock()
	if slices.ContainsFunc(c.cc.Queues, func(h QueueSpec) bool { return h.Name == q.Name }) {
		c.mu.Unlock()
		return nil
	}
	if len(c.found) == len(c.cc.Queues) {
		c.found = append(slices.Clone(c.found), st)
	}
	c.cc.Queues = append(slices.Clone(c.cc.Queues), q)
	if c.added == nil {
		c.added = map[string]bool{}
	}
	c.added[q.Name] = true
	c.mu.Unlock()
	if err := c.applyTopology(); err != nil {
		c.removeQueue(q.Name)
		return fmt.Errorf("consume %s: %w", q.Name, err)
	}
	return nil
}

// probe declares (or checks) q on a short-lived connection of its own and
// returns it as found.
func (c *Consumer) probe(q QueueSpec) (queueState, error) {
	ctx, cancel := context.WithTimeout(context.Background(), c.cfg.DialTimeout)
	defer cancel()
	conn, _, err := c.ep.dial(ctx, "declare")
	if err != nil {
		return queueState{}, fmt.Errorf("%w: %w", ErrNotConsuming, err)
	}
	defer func() { _ = conn.Close() }()
	sc := &scratch{conn: conn}
	defer sc.close()
	return ensure(sc, q, nil)
}

// CancelQueue stops consuming the queue named: its consumer is cancelled
// (the deliveries it already handed out stay valid) and it is left out on
// reconnect. It reports whether the queue was consumed.
func (c *Consumer) CancelQueue(name string) (bool, error) {
	if !c.removeQueue(name) {
		return false, nil
	}
	return true, c.applyTopology()
}

// removeQueue drops the queue named from the configuration.
func (c *Consumer) removeQueue(name string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.removeQueueLocked(name)
}

// removeQueueLocked is removeQueue; c.mu is held.
func (c *Consumer) removeQueueLocked(name string) bool {
	delete(c.added, name)
	i := slices.IndexFunc(c.cc.Queues, func(h QueueSpec) bool { return h.Name == name })
	if i < 0 {
		return false
	}
	c.cc.Queues = slices.Delete(slices.Clone(c.cc.Queues), i, i+1)
	if i < len(c.found) {
		c.found = slices.Delete(slices.Clone(c.found), i, i+1)
	}
	return true
}

// configured returns a copy of the configured queues.
func (c *Consumer) configured() []QueueSpec {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.cc.Queues)
}

// applyTopology has the running session consume what is configured; with
// no session, the next connect does.
func (c *Consumer) applyTopology() error {
	req := topoReq{done: make(chan error, 1)}
	t := time.NewTimer(topoWait)
	defer t.Stop()
	select {
	case c.topo <- req:
	case <-t.C:
		return nil // not consuming now: applied on connect
	}
	select {
	case err := <-req.done:
		return err
	case <-t.C:
		return nil
	}
}

// refusedAdded reports whether err, from declaring a queue added at run
// time on a reconnect, is the broker's refusal of that queue (not a lost
// connection): the queue is then dropped.
func refusedAdded(err error) bool {
	return IsTopologyError(err) || brokerError(err) != nil
}

// syncQueues cancels the consumers of queues no longer configured, and
// consumes the queues newly configured (as AddQueue found them on a
// connection of its own; checked once more here on a side channel). A
// queue the broker refuses is returned, and the session goes on without
// that queue.
func (s *consumeSession) syncQueues() error {
	c := s.c
	want := c.configured()
	wanted := make(map[string]bool, len(want))
	for _, q := range want {
		wanted[q.Name] = true
	}
	have := make(map[string]bool, len(s.queues))
	c.mu.Lock()
	for tag, name := range s.tags {
		if wanted[name] {
			have[name] = true
			continue
		}
		delete(s.tags, tag)
		if err := s.st.ch.Cancel(tag, false); err != nil {
			c.mu.Unlock()
			return fmt.Errorf("cancel consumer of %q: %w", name, err)
		}
		c.log.Info("stopped consuming", zap.String("queue", name))
	}
	c.mu.Unlock()
	s.queues = slices.DeleteFunc(s.queues, func(q QueueSpec) bool { return !wanted[q.Name] })
	sc := &scratch{conn: s.conn}
	defer sc.close()
	for _, q := range want {
		if have[q.Name] {
			continue
		}
		st, known := c.foundState(q.Name)
		if known {
			// Probed on its own connection: only check that it is still
			// there, so that consuming it cannot close the channel.
			exists, err := queueExists(sc, q.Name)
			if err == nil && !exists {
				err = fmt.Errorf("%w: queue %q deleted meanwhile", ErrNotFound, q.Name)
			}
			if err != nil {
				return err
			}
		} else {
			var err error
			if st, err = ensure(sc, q, nil); err != nil {
				return err
			}
		}
		c.mu.Lock()
		if i := slices.IndexFunc(c.cc.Queues, func(h QueueSpec) bool { return h.Name == q.Name }); i >= 0 && i == len(c.found) {
			c.found = append(c.found, st)
		}
		var err error
		if s.global && (st.spec.isQuorum() || !(st.learned || st.created)) {
			err = s.perConsumer()
		}
		if err == nil {
			s.seq++
			tag := fmt.Sprintf("%s/%d/%d", c.cc.Tag, s.st.gen, s.seq)
			var dch <-chan amqp091.Delivery
			dch, err = s.st.ch.Consume(st.spec.Name, tag, false, false, false, false, nil)
			if err == nil {
				s.tags[tag] = st.spec.Name
				s.queues = append(s.queues, st.spec)
				s.forward(dch, st.spec.Name, st.spec.isQuorum(), st.spec.DeliveryLimit())
			}
		}
		c.mu.Unlock()
		if err != nil {
			return fmt.Errorf("consume %q: %w", q.Name, err)
		}
		c.log.Info("consuming", zap.String("queue", q.Name))
	}
	return nil
}

// foundState returns the queue named as found (by AddQueue's probe or the
// last connect), if it is.
func (c *Consumer) foundState(name string) (queueState, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	i := slices.IndexFunc(c.cc.Queues, func(h QueueSpec) bool { return h.Name == name })
	if i < 0 || i >= len(c.found) {
		return queueState{}, false
	}
	return c.found[i], true
}

// perConsumer moves the session from a global (channel) prefetch to a
// per-consumer one, which every queue type takes (a quorum queue refuses a
// consumer on a channel under global QoS, closing the connection): the
// consumers are cancelled (their deliveries stay valid), the global limit
// lifted and the consumers started again under the per-consumer limit.
// Until the deliveries taken before are settled, the window is the limit
// plus those. c.mu is held.
func (s *consumeSession) perConsumer() error {
	for tag := range s.tags {
		if err := s.st.ch.Cancel(tag, false); err != nil {
			return fmt.Errorf("cancel consumer %s: %w", tag, err)
		}
	}
	s.tags = map[string]string{}
	if err := s.st.ch.Qos(0, 0, true); err != nil {
		return fmt.Errorf("lift the global prefetch: %w", err)
	}
	s.global, s.c.global = false, false
	if err := s.startConsumers(); err != nil {
		return err
	}
	s.c.log.Info("prefetch now per consumer: a queue added at run time takes no global QoS", zap.Int("prefetch", s.applied))
	return nil
}
