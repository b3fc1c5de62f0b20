package replay

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"
)

// QueueDepth returns the number of messages ready in the queue (not
// counting those delivered and not yet acknowledged).
func (e *Env) QueueDepth(name string) (int, error) {
	q, err := e.inspectQueue(name)
	return q.Messages, err
}

// Consumers returns the number of consumers of the queue.
func (e *Env) Consumers() (int, error) {
	q, err := e.inspectQueue(e.Queue)
	return q.Consumers, err
}

// inspectQueue declares a queue passively. A missing queue closes the
// channel: it is opened again for the next call.
func (e *Env) inspectQueue(name string) (amqp091.Queue, error) {
	e.pubMu.Lock()
	defer e.pubMu.Unlock()
	if e.inspect == nil || e.inspect.IsClosed() {
		ch, err := e.conn.Channel()
		if err != nil {
			return amqp091.Queue{}, fmt.Errorf("inspect queue %s: %w", name, err)
		}
		e.inspect = ch
	}
	q, err := e.inspect.QueueDeclarePassive(name, true, false, false, false, nil)
	if err != nil {
		return q, fmt.Errorf("inspect queue %s: %w", name, err)
	}
	return q, nil
}

// Quarantined is a message a worker moved to the quarantine queue.
type Quarantined struct {
	TaskID, Reason, Detail string
}

// TakeQuarantined removes and returns every message in the quarantine
// queue (none when the queue was never declared).
func (e *Env) TakeQuarantined() ([]Quarantined, error) {
	if n, err := e.QueueDepth(e.Quarantine); err != nil || n == 0 {
		var aerr *amqp091.Error
		if errors.As(err, &aerr) && aerr.Code == amqp091.NotFound {
			return nil, nil // never declared: nothing quarantined
		}
		return nil, err
	}
	e.pubMu.Lock()
	defer e.pubMu.Unlock()
	var out []Quarantined
	for {
		d, ok, err := e.inspect.Get(e.Quarantine, true)
		if err != nil {
			return out, fmt.Errorf("get quarantined: %w", err)
		}
		if !ok {
			return out, nil
		}
		reason, _ := d.Headers["x-onceler-reason"].(string)
		detail, _ := d.Headers["x-onceler-detail"].(string)
		out = append(out, Quarantined{TaskID: d.CorrelationId, Reason: reason, Detail: detail})
	}
}

// StaleClaims returns how many records are claimed with a lapsed lease:
// operations nobody is finishing.
func (e *Env) StaleClaims(ctx context.Context) (int, error) {
	var n int
	err := e.Pool.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{e.Schema, "records"}.Sanitize()+
		` WHERE status = 'claimed' AND lease_until < now()`).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("count stale claims: %w", err)
	}
	return n, nil
}

// Takeovers returns how many stale claims of task the record took over
// since the given time (policy retry or lookup).
func (e *Env) Takeovers(ctx context.Context, task string, since time.Time) (int64, error) {
	stats, err := e.Store.Repeats(ctx, since)
	if err != nil {
		return 0, err
	}
	for _, s := range stats {
		if s.Task == task {
			return s.Takeovers, nil
		}
	}
	return 0, nil
}
