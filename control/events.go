package control

import (
	"context"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"

	amqp091 "github.com/onceler/onceler/internal/amqp091"
	"go.uber.org/zap"

	"github.com/onceler/onceler/celeryproto"
)

// Version is the software version reported as sw_ver in worker events.
const Version = "0.1.0"

// queuedEvent is an event waiting for the publisher: its stamp and the
// caller's fields (a task event's as a value, any other's as a map),
// encoded only by the publisher goroutine.
type queuedEvent struct {
	stamp  celeryproto.EventStamp
	fields map[string]any
	task   *celeryproto.TaskEvent
}

// Event implements tasks.Observer. It never blocks: when task events are off
// it returns at once; otherwise it stamps the event (type, hostname, pid,
// clock, timestamp, utcoffset) and queues it for the publisher, dropping and
// counting it when the buffer is full. The controller takes ownership of
// fields (it reads them later, on the publisher goroutine). Events of other
// groups than "task" are always queued.
func (c *Controller) Event(_ context.Context, typ string, fields map[string]any) {
	if strings.HasPrefix(typ, "task-") && !c.taskEvents.Load() {
		return
	}
	c.queue(queuedEvent{stamp: c.stamp(typ), fields: fields})
}

// TaskEvent implements tasks.TaskEventObserver: Event for a task event
// given as a value, encoded without a map. The controller owns e.
func (c *Controller) TaskEvent(_ context.Context, e *celeryproto.TaskEvent) {
	if !c.taskEvents.Load() {
		return
	}
	c.queue(queuedEvent{stamp: c.stamp(e.Type), task: e})
}

func (c *Controller) queue(ev queuedEvent) {
	c.pending.Add(1)
	select {
	case c.events <- ev:
	default:
		c.pending.Add(-1)
		c.dropped.Add(1)
	}
}

func (c *Controller) stamp(typ string) celeryproto.EventStamp {
	return celeryproto.EventStamp{
		Type:      typ,
		Hostname:  c.cfg.NodeName,
		PID:       c.pid,
		Clock:     c.clock.Add(1),
		Timestamp: float64(time.Now().UnixNano()) / 1e9,
		UTCOffset: c.utcoffset,
	}
}

// utcoffset is Celery's utcoffset(): hours west of UTC, floored.
func utcoffset() int {
	_, east := time.Now().Zone()
	west := -east
	h := west / 3600
	if west%3600 != 0 && west < 0 {
		h--
	}
	return h
}

// workerEvent builds a worker-online / heartbeat / offline event as Celery's
// Heart sends it.
func (c *Controller) workerEvent(typ string) queuedEvent {
	w := c.worker()
	return queuedEvent{stamp: c.stamp(typ), fields: map[string]any{
		"freq":      c.cfg.Heartbeat.Seconds(),
		"active":    len(w.Active()),
		"processed": processed(w.Stats()),
		"loadavg":   loadavg(),
		"sw_ident":  "onceler",
		"sw_ver":    Version,
		"sw_sys":    sysName(),
	}}
}

func (c *Controller) sendWorkerEvent(typ string) {
	c.pending.Add(1)
	select {
	case c.sys <- c.workerEvent(typ):
	default:
		c.pending.Add(-1)
		c.dropped.Add(1)
	}
}

// publishLoop publishes queued events until ctx is done: worker events one
// by one as they come, task events every Config.EventLinger in batches of up
// to maxEventsPerMessage (a task.multi message, as Celery's worker buffers
// task events). Task events are collected by draining the buffer on a
// ticker, so that Event never wakes this goroutine: a task pays for a
// channel send only. Events queued while there is no connection are dropped
// and counted: events are not durable in Celery either.
func (c *Controller) publishLoop(ctx context.Context) {
	buf := make([]byte, 0, 32<<10)
	batch := make([]queuedEvent, 0, maxEventsPerMessage)
	tick := time.NewTicker(c.cfg.EventLinger)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case ev := <-c.sys:
			buf = c.publishBatch(ctx, buf[:0], []queuedEvent{ev})
			c.pending.Add(-1)
		case <-tick.C:
			for n := len(c.events); n > 0; n = min(n, len(c.events)) {
				batch = batch[:0]
				for range min(n, maxEventsPerMessage) {
					batch = append(batch, <-c.events)
				}
				n -= len(batch)
				buf = c.publishBatch(ctx, buf[:0], batch)
				c.pending.Add(-int64(len(batch)))
				clear(batch) // let the fields maps go
			}
		}
	}
}

// publishBatch encodes and publishes events: one as an object on its own
// routing key, several as a list on task.multi.
func (c *Controller) publishBatch(ctx context.Context, buf []byte, batch []queuedEvent) []byte {
	ch := c.evCh.Load()
	if ch == nil {
		c.failed.Add(int64(len(batch)))
		return buf
	}
	if len(batch) > 1 {
		buf = append(buf, '[')
	}
	n := 0
	for _, ev := range batch {
		mark := len(buf)
		if n > 0 {
			buf = append(buf, ',')
		}
		var err error
		if ev.task != nil {
			buf, err = celeryproto.AppendTaskEvent(buf, ev.stamp, ev.task)
		} else {
			buf, err = celeryproto.AppendEvent(buf, ev.stamp, ev.fields)
		}
		if err != nil {
			buf = buf[:mark]
			c.failed.Add(1)
			c.log.Warn("event not encodable: dropped", zap.String("type", ev.stamp.Type), zap.Error(err))
			continue
		}
		n++
	}
	if n == 0 {
		return buf
	}
	key := celeryproto.EventRoutingKey(batch[0].stamp.Type)
	if len(batch) > 1 {
		buf = append(buf, ']')
		key = celeryproto.EventMultiRoutingKey
	}
	p := celeryproto.EventPublishing(c.cfg.NodeName, buf)
	if err := ch.PublishWithContext(ctx, EventExchange, key, false, false, publishing(p)); err != nil {
		c.failed.Add(int64(n))
		c.log.Debug("events not published", zap.Int("events", n), zap.Error(err))
		return buf
	}
	c.sent.Add(int64(n))
	return buf
}

func publishing(p *celeryproto.Publishing) amqp091.Publishing {
	return amqp091.Publishing{
		Headers:         amqp091.Table(p.Headers),
		ContentType:     p.ContentType,
		ContentEncoding: p.ContentEncoding,
		DeliveryMode:    p.DeliveryMode,
		Priority:        p.Priority,
		CorrelationId:   p.CorrelationID,
		ReplyTo:         p.ReplyTo,
		Expiration:      p.Expiration,
		Body:            p.Body,
	}
}

// processed sums Stats()["total"].
func processed(stats map[string]any) int64 {
	var n int64
	switch t := stats["total"].(type) {
	case map[string]int64:
		for _, v := range t {
			n += v
		}
	case map[string]int:
		for _, v := range t {
			n += int64(v)
		}
	case map[string]any:
		for _, v := range t {
			switch x := v.(type) {
			case int64:
				n += x
			case int:
				n += int64(x)
			case uint64:
				n += int64(x)
			case float64:
				n += int64(x)
			}
		}
	}
	return n
}

// loadavg reads /proc/loadavg as Celery's load_average (rounded to 2
// places); zeros where it is unavailable.
func loadavg() []any {
	out := []any{0.0, 0.0, 0.0}
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return out
	}
	for i, f := range strings.Fields(string(b)) {
		if i == 3 {
			break
		}
		if v, err := strconv.ParseFloat(f, 64); err == nil {
			out[i] = v
		}
	}
	return out
}

func sysName() string {
	if runtime.GOOS == "" {
		return "Unknown"
	}
	return strings.ToUpper(runtime.GOOS[:1]) + runtime.GOOS[1:]
}
