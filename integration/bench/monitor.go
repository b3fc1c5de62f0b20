package main

import (
	"bytes"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceler/onceler/control"
)

// Monitor modes of (f): how the events reach a monitor.
const (
	// monitorAfter binds the monitor's queue before the run and reads it
	// once the worker is done: the broker routes and keeps every event
	// while the tasks drain, and the monitor's own reading, which belongs
	// to the machine Flower runs on, falls outside the measured window.
	monitorAfter = "after"
	// monitorLive consumes the events while the tasks drain, on the same
	// two cores as the worker, the broker and PostgreSQL.
	monitorLive = "live"
	// monitorNone binds no queue: the broker drops the events, as when no
	// Flower is connected.
	monitorNone = "none"
)

// monitor is what `celery events` or Flower does to a worker's events: a
// queue of its own bound to the celeryev exchange for every event, consumed
// without acknowledgements. It counts task-succeeded events (a task.multi
// message holds several) without decoding them, so that its own CPU, on the
// same machine as the worker, stays small.
type monitor struct {
	ch        *amqp091.Channel
	queue     string
	succeeded atomic.Int64
	messages  atomic.Int64
	done      sync.WaitGroup
}

var succeededMark = []byte(`"task-succeeded"`)

// startMonitor declares and binds the monitor's queue; with live it also
// starts consuming it (else call consume later).
func startMonitor(b *broker, queue string, live bool) (*monitor, error) {
	ch, err := b.conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("monitor: channel: %w", err)
	}
	m := &monitor{ch: ch, queue: queue}
	err = func() error {
		if err := ch.ExchangeDeclare(control.EventExchange, "topic", true, false, false, false, nil); err != nil {
			return fmt.Errorf("monitor: declare %s: %w", control.EventExchange, err)
		}
		if _, err := ch.QueueDeclare(queue, false, true, true, false, nil); err != nil {
			return fmt.Errorf("monitor: declare %s: %w", queue, err)
		}
		if err := ch.QueueBind(queue, "#", control.EventExchange, false, nil); err != nil {
			return fmt.Errorf("monitor: bind %s: %w", queue, err)
		}
		if live {
			return m.consume()
		}
		return nil
	}()
	if err != nil {
		_ = ch.Close()
		return nil, err
	}
	return m, nil
}

// consume reads the queue until the channel closes, counting events.
func (m *monitor) consume() error {
	in, err := m.ch.Consume(m.queue, "", true, true, false, false, nil)
	if err != nil {
		return fmt.Errorf("monitor: consume %s: %w", m.queue, err)
	}
	m.done.Go(func() {
		for d := range in {
			m.messages.Add(1)
			m.succeeded.Add(int64(bytes.Count(d.Body, succeededMark)))
		}
	})
	return nil
}

// wait waits up to timeout for n task-succeeded events (the worker
// publishes them in batches, a moment after the tasks). A delivery the
// broker hands out again (answered from the record) has its own
// task-succeeded, so more than n is not an error; fewer is.
func (m *monitor) wait(n int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for m.succeeded.Load() < int64(n) && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if got := m.succeeded.Load(); got < int64(n) {
		return fmt.Errorf("the events monitor saw %d task-succeeded events in %d messages, want %d", got, m.messages.Load(), n)
	}
	return nil
}

func (m *monitor) close() {
	_ = m.ch.Close() // ends the consumer; the exclusive queue goes with it
	m.done.Wait()
}
