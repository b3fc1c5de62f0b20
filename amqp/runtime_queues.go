package amqp

import (
	"fmt"
	"slices"
	"time"

	"go.uber.org/zap"
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

// AddQueue starts consuming q: it is declared (or checked, when passive) as
// a configured queue is, now and on every reconnect, and consumed. A queue
// consumed already is left as it is. An error (the broker refused the
// declare) leaves the queue out.
func (c *Consumer) AddQueue(q QueueSpec) error {
	if q.Name == "" {
		return fmt.Errorf("%w: queue spec without a name", ErrConfig)
	}
	c.mu.Lock()
	if slices.ContainsFunc(c.cc.Queues, func(h QueueSpec) bool { return h.Name == q.Name }) {
		c.mu.Unlock()
		return nil
	}
	c.cc.Queues = append(slices.Clone(c.cc.Queues), q)
	c.mu.Unlock()
	if err := c.applyTopology(); err != nil {
		c.removeQueue(q.Name)
		return fmt.Errorf("consume %s: %w", q.Name, err)
	}
	return nil
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

// syncQueues cancels the consumers of queues no longer configured, and
// declares and consumes the queues newly configured. A declare the broker
// refuses is returned, and the session goes on without that queue.
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
		st, err := ensure(sc, q, nil)
		if err != nil {
			return err
		}
		c.mu.Lock()
		if i := slices.IndexFunc(c.cc.Queues, func(h QueueSpec) bool { return h.Name == q.Name }); i >= 0 && i == len(c.found) {
			c.found = append(c.found, st)
		}
		s.seq++
		tag := fmt.Sprintf("%s/%d/%d", c.cc.Tag, s.st.gen, s.seq)
		dch, err := s.st.ch.Consume(st.spec.Name, tag, false, false, false, false, nil)
		if err == nil {
			s.tags[tag] = st.spec.Name
			s.queues = append(s.queues, st.spec)
			s.forward(dch, st.spec.Name, st.spec.isQuorum())
		}
		c.mu.Unlock()
		if err != nil {
			return fmt.Errorf("consume %q: %w", q.Name, err)
		}
		c.log.Info("consuming", zap.String("queue", q.Name))
	}
	return nil
}
