package control

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
	amqp091 "github.com/onceler/onceler/internal/amqp091"
)

// testWorker is a small but real Worker: it consumes a Celery queue, runs
// demo.sleep and demo.add, publishes rpc results, honours revocation on
// receipt and before running, cancels a terminated task's context, and
// reports task events to an Observer. It stands in for tasks.Worker so the
// controller is tested against real Celery on its own.
type testWorker struct {
	t        *testing.T
	url      string
	queue    string
	node     string
	observer interface {
		Event(ctx context.Context, typ string, fields map[string]any)
	}
	revoked *Revoked

	mu       sync.Mutex
	active   map[string]*running
	reserved map[string]TaskInfo
	totals   map[string]int64
}

type running struct {
	info   TaskInfo
	cancel context.CancelCauseFunc
}

var errTerminated = errors.New("terminated")

func newTestWorker(t *testing.T, url, queue, node string) *testWorker {
	return &testWorker{t: t, url: url, queue: queue, node: node, revoked: NewRevoked(100, time.Hour),
		active: map[string]*running{}, reserved: map[string]TaskInfo{}, totals: map[string]int64{}}
}

func (w *testWorker) Registered() []string { return []string{"demo.sleep", "demo.add"} }

func (w *testWorker) Active() []TaskInfo {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []TaskInfo
	for _, r := range w.active {
		out = append(out, r.info)
	}
	return out
}

func (w *testWorker) Reserved() []TaskInfo {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []TaskInfo
	for _, ti := range w.reserved {
		out = append(out, ti)
	}
	return out
}

func (w *testWorker) Scheduled() []TaskInfo { return nil }

func (w *testWorker) Queues() []amqp.QueueSpec {
	return []amqp.QueueSpec{{Name: w.queue, Durable: true, Args: map[string]any{"x-max-priority": int32(10)}}}
}

func (w *testWorker) Revoke(ids []string, terminate bool) {
	w.revoked.Add(ids...)
	if !terminate {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, id := range ids {
		if r, ok := w.active[id]; ok {
			r.cancel(errTerminated)
		}
	}
}

func (w *testWorker) Stats() map[string]any {
	w.mu.Lock()
	defer w.mu.Unlock()
	total := map[string]any{}
	for k, v := range w.totals {
		total[k] = v
	}
	return map[string]any{"total": total}
}

func (w *testWorker) event(typ string, id string, fields map[string]any) {
	if w.observer == nil {
		return
	}
	if fields == nil {
		fields = map[string]any{}
	}
	fields["uuid"] = id
	w.observer.Event(context.Background(), typ, fields)
}

// run consumes until ctx is done, with concurrency goroutines.
func (w *testWorker) run(ctx context.Context, concurrency int) error {
	conn, err := amqp091.Dial(w.url)
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	if err := ch.ExchangeDeclare(w.queue, "direct", true, false, false, false, nil); err != nil {
		return err
	}
	if _, err := ch.QueueDeclare(w.queue, true, false, false, false, nil); err != nil {
		return err
	}
	if err := ch.QueueBind(w.queue, w.queue, w.queue, false, nil); err != nil {
		return err
	}
	if err := ch.Qos(concurrency, 0, false); err != nil {
		return err
	}
	deliveries, err := ch.ConsumeWithContext(ctx, w.queue, "", false, false, false, false, nil)
	if err != nil {
		return err
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	slots := make(chan struct{}, concurrency)
	for {
		select {
		case <-ctx.Done():
			return nil
		case d, ok := <-deliveries:
			if !ok {
				return nil
			}
			msg, err := celeryproto.Decode(&celeryproto.Delivery{ContentType: d.ContentType, ContentEncoding: d.ContentEncoding,
				Headers: d.Headers, Body: d.Body, CorrelationID: d.CorrelationId, ReplyTo: d.ReplyTo})
			if err != nil {
				w.t.Errorf("test worker: decode: %v", err)
				_ = d.Nack(false, false)
				continue
			}
			if w.revoked.Contains(msg.ID) {
				w.finish(ctx, ch, d, msg, revokedResult(msg.ID, "revoked"), map[string]any{"terminated": false, "signum": nil, "expired": false})
				continue
			}
			w.event("task-received", msg.ID, map[string]any{"name": msg.Task, "args": msg.ArgsRepr, "kwargs": msg.KwargsRepr,
				"root_id": msg.RootID, "parent_id": nil, "retries": msg.Retries, "eta": nil, "expires": nil})
			info := TaskInfo{ID: msg.ID, Name: msg.Task, ArgsRepr: msg.ArgsRepr, KwargsRepr: msg.KwargsRepr,
				Exchange: d.Exchange, RoutingKey: d.RoutingKey, Priority: d.Priority, Redelivered: d.Redelivered}
			w.mu.Lock()
			w.reserved[msg.ID] = info
			w.mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				select {
				case slots <- struct{}{}:
				case <-ctx.Done():
					return
				}
				defer func() { <-slots }()
				w.execute(ctx, ch, d, msg, info)
			}()
		}
	}
}

func (w *testWorker) execute(ctx context.Context, ch *amqp091.Channel, d amqp091.Delivery, msg *celeryproto.Message, info TaskInfo) {
	w.mu.Lock()
	delete(w.reserved, msg.ID)
	w.mu.Unlock()
	if w.revoked.Contains(msg.ID) {
		w.finish(ctx, ch, d, msg, revokedResult(msg.ID, "revoked"), map[string]any{"terminated": false, "signum": nil, "expired": false})
		return
	}
	tctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	info.Started = time.Now()
	w.mu.Lock()
	w.active[msg.ID] = &running{info: info, cancel: cancel}
	w.mu.Unlock()
	w.event("task-started", msg.ID, nil)
	value, err := runDemo(tctx, msg)
	w.mu.Lock()
	delete(w.active, msg.ID)
	w.totals[msg.Task]++
	w.mu.Unlock()
	switch {
	case errors.Is(context.Cause(tctx), errTerminated):
		w.finish(ctx, ch, d, msg, revokedResult(msg.ID, "terminated"), map[string]any{"terminated": true, "signum": 15, "expired": false})
	case err != nil:
		w.finish(ctx, ch, d, msg, &celeryproto.Result{TaskID: msg.ID, Status: celeryproto.StateFailure,
			Exception: &celeryproto.Exception{Type: "ValueError", Module: "builtins", Message: err.Error()}}, nil)
	default:
		raw, _ := json.Marshal(value)
		w.event("task-succeeded", msg.ID, map[string]any{"result": string(raw), "runtime": time.Since(info.Started).Seconds()})
		w.finish(ctx, ch, d, msg, &celeryproto.Result{TaskID: msg.ID, Status: celeryproto.StateSuccess, Value: value}, nil)
	}
}

func runDemo(ctx context.Context, msg *celeryproto.Message) (any, error) {
	switch msg.Task {
	case "demo.sleep":
		secs, _ := msg.Args[0].(float64)
		if n, ok := msg.Args[0].(int64); ok {
			secs = float64(n)
		}
		select {
		case <-time.After(time.Duration(secs * float64(time.Second))):
			return secs, nil
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		}
	case "demo.add":
		x, _ := msg.Args[0].(int64)
		y, _ := msg.Args[1].(int64)
		return x + y, nil
	}
	return nil, fmt.Errorf("unknown task %s", msg.Task)
}

func revokedResult(id, reason string) *celeryproto.Result {
	return &celeryproto.Result{TaskID: id, Status: celeryproto.StateRevoked,
		Exception: &celeryproto.Exception{Type: "TaskRevokedError", Module: "celery.exceptions", Message: reason}}
}

// finish publishes the result to reply_to, sends task-revoked when the
// result is REVOKED, then acknowledges.
func (w *testWorker) finish(ctx context.Context, ch *amqp091.Channel, d amqp091.Delivery, msg *celeryproto.Message, r *celeryproto.Result, revokedFields map[string]any) {
	if r.Status == celeryproto.StateRevoked {
		w.event("task-revoked", msg.ID, revokedFields)
	}
	if msg.ReplyTo != "" {
		p, err := celeryproto.EncodeResult(r)
		if err != nil {
			w.t.Errorf("test worker: encode result: %v", err)
			return
		}
		if err := ch.PublishWithContext(context.WithoutCancel(ctx), "", msg.ReplyTo, false, false, publishing(p)); err != nil {
			w.t.Errorf("test worker: publish result: %v", err)
			return
		}
	}
	_ = d.Ack(false)
}

func newUnitController(t *testing.T, cfg Config) *Controller {
	t.Helper()
	cfg.URL = "amqp://guest:secret@127.0.0.1:1/"
	if cfg.NodeName == "" {
		cfg.NodeName = "onceler-1@box"
	}
	c, err := New(newTestWorker(t, "", "", ""), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c
}
