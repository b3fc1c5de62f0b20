package control

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"go.uber.org/zap"

	"github.com/onceler/onceler/celeryproto"
)

// Version is the software version reported as sw_ver in worker events.
const Version = "0.1.0"

// onceler-specific event fields; Celery's readers keep unknown fields as
// attributes of the task or worker, so Flower and celery.events.State show
// them without breaking.
const (
	// FieldDuplicate is set true on task-succeeded / task-failed when the
	// delivery was a duplicate whose stored outcome was replied instead of
	// running the task again.
	FieldDuplicate = "onceler_duplicate"
	// FieldKeyHash is KeyHash(operation key): it identifies the operation
	// without revealing the key.
	FieldKeyHash = "onceler_key_sha256"
)

// KeyHash returns the first 16 hex digits of the SHA-256 of an operation
// key, for FieldKeyHash.
func KeyHash(key string) string {
	sum := sha256.Sum256([]byte(key))
	return hex.EncodeToString(sum[:8])
}

// Event implements tasks.Observer. It never blocks: when task events are off
// it returns at once; otherwise it stamps the event (type, hostname, pid,
// clock, timestamp, utcoffset) and queues it for the publisher, dropping and
// counting it when the buffer is full. The controller takes ownership of
// fields. Events of other groups than "task" are always queued.
func (c *Controller) Event(_ context.Context, typ string, fields map[string]any) {
	if strings.HasPrefix(typ, "task-") && !c.taskEvents.Load() {
		return
	}
	if fields == nil {
		fields = make(map[string]any, 8)
	}
	c.stamp(typ, fields)
	select {
	case c.events <- fields:
	default:
		c.dropped.Add(1)
	}
}

func (c *Controller) stamp(typ string, fields map[string]any) {
	fields["type"] = typ
	fields["hostname"] = c.cfg.NodeName
	fields["pid"] = c.pid
	fields["clock"] = c.clock.Add(1)
	if _, ok := fields["timestamp"]; !ok {
		fields["timestamp"] = float64(time.Now().UnixNano()) / 1e9
	}
	fields["utcoffset"] = utcoffset()
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
func (c *Controller) workerEvent(typ string) map[string]any {
	active := len(c.worker().Active())
	ev := map[string]any{
		"freq":      c.cfg.Heartbeat.Seconds(),
		"active":    active,
		"processed": processed(c.worker().Stats()),
		"loadavg":   loadavg(),
		"sw_ident":  "onceler",
		"sw_ver":    Version,
		"sw_sys":    sysName(),
	}
	c.stamp(typ, ev)
	return ev
}

func (c *Controller) sendWorkerEvent(typ string) {
	select {
	case c.sys <- c.workerEvent(typ):
	default:
		c.dropped.Add(1)
	}
}

// publishLoop publishes queued events until ctx is done: worker events one
// by one, task events in batches of up to maxEventsPerMessage (a task.multi
// message, as Celery's worker buffers them). Events queued while there is no
// connection are dropped and counted: events are not durable in Celery
// either.
func (c *Controller) publishLoop(ctx context.Context) {
	batch := make([]map[string]any, 0, maxEventsPerMessage)
	for {
		batch = batch[:0]
		select {
		case <-ctx.Done():
			return
		case ev := <-c.sys:
			batch = append(batch, ev)
		case ev := <-c.events:
			batch = append(batch, ev)
		fill:
			for len(batch) < maxEventsPerMessage {
				select {
				case ev := <-c.events:
					batch = append(batch, ev)
				default:
					break fill
				}
			}
		}
		ch := c.evCh.Load()
		if ch == nil {
			c.failed.Add(int64(len(batch)))
			continue
		}
		if err := c.publishEvents(ctx, ch, batch); err != nil {
			c.failed.Add(int64(len(batch)))
			c.log.Debug("events not published", zap.Int("events", len(batch)), zap.Error(err))
		}
	}
}

func (c *Controller) publishEvents(ctx context.Context, ch *amqp091.Channel, batch []map[string]any) error {
	var (
		p   *celeryproto.Publishing
		key string
		err error
	)
	if len(batch) == 1 {
		key = celeryproto.EventRoutingKey(batch[0]["type"].(string))
		p, err = celeryproto.EncodeEvent(batch[0])
	} else {
		key = celeryproto.EventMultiRoutingKey
		p, err = celeryproto.EncodeEvents(batch)
	}
	if err != nil {
		return fmt.Errorf("control: encode events: %w", err)
	}
	if err := ch.PublishWithContext(ctx, EventExchange, key, false, false, publishing(p)); err != nil {
		return fmt.Errorf("control: publish %s: %w", key, err)
	}
	c.sent.Add(int64(len(batch)))
	return nil
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
