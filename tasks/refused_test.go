package tasks

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// hostileRegistry has h.add (pure), h.fail (pure, ValueError), h.retry
// (pure, asks for a retry), h.pay (outside) and h.credit (same database);
// runs counts their runs by task id.
func hostileRegistry(t *testing.T, runs *effects) *Registry {
	t.Helper()
	r := NewRegistry()
	for _, err := range []error{
		Register(r, Task[addArgs]{Name: "h.add", Run: func(_ context.Context, c *Call, a addArgs) (any, error) {
			runs.add(c.TaskID)
			return a.X + a.Y, nil
		}}),
		Register(r, Task[addArgs]{Name: "h.fail", Run: func(_ context.Context, c *Call, _ addArgs) (any, error) {
			runs.add(c.TaskID)
			return nil, ValueError("no good")
		}}),
		Register(r, Task[addArgs]{Name: "h.retry", Run: func(_ context.Context, c *Call, _ addArgs) (any, error) {
			runs.add(c.TaskID)
			return nil, c.Retry(time.Millisecond, nil)
		}}),
		Register(r, Task[payArgs]{Name: "h.pay", Mode: ModeOutside, Policy: PolicyRetry,
			Key: func(a payArgs) (string, error) { return a.OrderID, nil },
			Run: func(_ context.Context, c *Call, a payArgs) (any, error) {
				runs.add(c.TaskID)
				return a.Amount, nil
			}}),
		Register(r, Task[payArgs]{Name: "h.credit", Mode: ModeSameDB,
			Key: func(a payArgs) (string, error) { return a.OrderID, nil },
			RunTx: func(_ context.Context, _ pgx.Tx, c *Call, a payArgs) (any, error) {
				runs.add(c.TaskID)
				return a.Amount, nil
			}}),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	return r
}

// hostile is a message whose follow-up publish the broker refuses for
// what it is, and how the worker must answer it.
type hostile struct {
	name       string
	msg        func(id, replyTo string) *celeryproto.Message
	answer     string // "STATUS" or "STATUS exc_type"; "" for none
	quarantine string // the reason, "" for none
}

var (
	long300        = strings.Repeat("L", 300)
	missingExchage = testenv.Name("onceler_no_such_exchange")
)

func hostiles() []hostile {
	add := func(id, replyTo string) *celeryproto.Message {
		return &celeryproto.Message{Protocol: 2, Task: "h.add", ID: id, Args: []any{int64(1), int64(2)}, ReplyTo: replyTo}
	}
	step := func(opts map[string]any) []celeryproto.Signature {
		return []celeryproto.Signature{{Task: "h.add", Args: []any{int64(1)}, Options: opts}}
	}
	return []hostile{
		{"chain step to a missing exchange", func(id, replyTo string) *celeryproto.Message {
			m := add(id, replyTo)
			m.Chain = step(map[string]any{"exchange": missingExchage, "routing_key": "k"})
			return m
		}, "FAILURE PublishRefused", ReasonPublishRefused},
		{"link to amq.foo", func(id, replyTo string) *celeryproto.Message {
			m := add(id, replyTo)
			m.Callbacks = step(map[string]any{"exchange": "amq.foo", "routing_key": "k"})
			return m
		}, "FAILURE PublishRefused", ReasonPublishRefused},
		{"link to the internal exchange amq.rabbitmq.trace", func(id, replyTo string) *celeryproto.Message {
			m := add(id, replyTo)
			m.Callbacks = step(map[string]any{"exchange": "amq.rabbitmq.trace", "routing_key": "k"})
			return m
		}, "FAILURE PublishRefused", ReasonPublishRefused},
		{"chain step to the reserved queue amq.foo", func(id, replyTo string) *celeryproto.Message {
			m := add(id, replyTo)
			m.Chain = step(map[string]any{"queue": "amq.foo"})
			return m
		}, "FAILURE PublishRefused", ReasonPublishRefused},
		{"chain step with a task id of 300 bytes", func(id, replyTo string) *celeryproto.Message {
			m := add(id, replyTo)
			m.Chain = step(map[string]any{"task_id": long300})
			return m
		}, "FAILURE PublishRefused", ReasonPublishRefused},
		{"errback to a missing exchange", func(id, replyTo string) *celeryproto.Message {
			m := add(id, replyTo)
			m.Task = "h.fail"
			m.Errbacks = step(map[string]any{"exchange": missingExchage, "routing_key": "k"})
			return m
		}, "FAILURE ValueError", ReasonPublishRefused},
		{"outside task with a link to a missing exchange", func(id, replyTo string) *celeryproto.Message {
			return &celeryproto.Message{Protocol: 2, Task: "h.pay", ID: id, ReplyTo: replyTo,
				Kwargs:    map[string]any{"order_id": "order-" + id, "amount": int64(7)},
				Callbacks: step(map[string]any{"exchange": missingExchage, "routing_key": "k"})}
		}, "FAILURE PublishRefused", ReasonPublishRefused},
		{"same-database task with a chain step to a missing exchange", func(id, replyTo string) *celeryproto.Message {
			return &celeryproto.Message{Protocol: 2, Task: "h.credit", ID: id, ReplyTo: replyTo,
				Kwargs: map[string]any{"order_id": "order-" + id, "amount": int64(7)},
				Chain:  step(map[string]any{"exchange": missingExchage, "routing_key": "k"})}
		}, "FAILURE PublishRefused", ReasonPublishRefused},
		{"retry of a task whose id is 300 bytes", func(id, replyTo string) *celeryproto.Message {
			m := add(id+long300, replyTo)
			m.Task = "h.retry"
			return m
		}, "FAILURE PublishRefused", ReasonPublishRefused},
		{"task id of 300 bytes", func(id, replyTo string) *celeryproto.Message {
			return add(id+long300, replyTo)
		}, "SUCCESS", ""},
		{"reply_to amq.rabbitmq.reply-to.<garbage>", func(id, _ string) *celeryproto.Message {
			return add(id, "amq.rabbitmq.reply-to.g2dkAA.x")
		}, "", ""},
	}
}

// publishHostile publishes m as bytes with amqp091-go, as a producer
// would: the correlation id is left out when it cannot be sent.
func (e *env) publishHostile(m *celeryproto.Message) {
	e.t.Helper()
	p, err := celeryproto.EncodeTask(m, celeryproto.EncodeOptions{})
	if err != nil {
		e.t.Fatal(err)
	}
	if len(p.CorrelationID) > 255 {
		p.CorrelationID = ""
	}
	e.publishRaw(p)
}

// TestRefusedPublishIsAnsweredOnce: each message whose step, link,
// errback, retry or result the broker refuses for what it is runs once, is
// answered once where it can be (FAILURE PublishRefused for a refused
// follow-up) and quarantined once; it is not run again, and the worker
// serves the next task at once.
func TestRefusedPublishIsAnsweredOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	runs := &effects{}
	e.start(hostileRegistry(t, runs), e.config())
	replyTo, replies := e.replyQueue()
	hs := hostiles()
	ids := make([]string, len(hs))
	wantQ := map[string]int{}
	answers := 0
	for i, h := range hs {
		m := h.msg(taskID(i), replyTo)
		ids[i] = m.ID
		e.publishHostile(m)
		if h.quarantine != "" {
			wantQ[m.ID]++
		}
		if h.answer != "" {
			answers++
		}
	}
	var got []amqp091.Delivery
	testkit.WaitFor(t, "quarantined", 20*time.Second, func() bool {
		got = append(got, e.quarantined()...)
		return len(got) >= len(wantQ)
	})
	res := results(t, replies, answers, 20*time.Second)
	// Any repeat (a re-run every 2 s, a second answer) would show by now.
	time.Sleep(5 * time.Second)
	got = append(got, e.quarantined()...)
	for id, rs := range results(t, replies, len(replies), time.Second) {
		res[id] = append(res[id], rs...)
	}
	e.publish(&celeryproto.Message{Protocol: 2, Task: "h.add", ID: taskID(99), Args: []any{int64(20), int64(22)}, ReplyTo: replyTo, CorrelationID: taskID(99)})
	if r := results(t, replies, 1, 10*time.Second)[taskID(99)]; len(r) != 1 || fmt.Sprint(r[0]["result"]) != "42" {
		t.Errorf("the next task was answered %v, want 42", r)
	}
	gotQ := map[string]int{}
	for _, d := range got {
		id := fmt.Sprint(d.Headers["id"])
		gotQ[id]++
		if id == ids[0] && d.Headers[HeaderReason] != ReasonPublishRefused {
			t.Errorf("quarantined as %v", d.Headers[HeaderReason])
		}
	}
	n := runs.snapshot()
	for i, h := range hs {
		id := ids[i]
		if n[id] != 1 {
			t.Errorf("%s: ran %d times, want once", h.name, n[id])
		}
		if gotQ[id] != wantQ[id] {
			t.Errorf("%s: quarantined %d times, want %d", h.name, gotQ[id], wantQ[id])
		}
		rs := res[id]
		if h.answer == "" {
			if len(rs) != 0 {
				t.Errorf("%s: answered %v, want nothing", h.name, rs)
			}
			continue
		}
		if len(rs) != 1 {
			t.Errorf("%s: answered %d times (%v), want once %s", h.name, len(rs), rs, h.answer)
			continue
		}
		status, exc, _ := strings.Cut(h.answer, " ")
		r := rs[0]
		if r["status"] != status {
			t.Errorf("%s: answered %v, want %s", h.name, r, h.answer)
		}
		if exc != "" {
			rr, _ := r["result"].(map[string]any)
			if rr["exc_type"] != exc {
				t.Errorf("%s: answered %v, want %s", h.name, r, h.answer)
			}
			if exc == "PublishRefused" && rr["exc_module"] != "onceler.exceptions" {
				t.Errorf("%s: exception module %v", h.name, rr["exc_module"])
			}
		}
	}
	if d := e.queueDepth(e.queue); d != 0 {
		t.Errorf("queue holds %d messages", d)
	}
	// The operations of record tasks stay completed.
	for i, h := range hs {
		m := h.msg(taskID(i), replyTo)
		if m.Task != "h.pay" && m.Task != "h.credit" {
			continue
		}
		rec, err := e.store.Get(context.Background(), m.Task, "order-"+m.ID)
		if err != nil || rec.Status != idempotency.StatusCompleted {
			t.Errorf("%s: record %+v, %v; want completed", h.name, rec, err)
		}
	}
}

// TestRefusedPublishesDoNotStallTheWorker: 40 messages whose follow-ups
// the broker refuses, with a prefetch of 4, do not hold the worker: each
// runs once and a normal task behind them is answered.
func TestRefusedPublishesDoNotStallTheWorker(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	runs := &effects{}
	cfg := e.config()
	cfg.Prefetch, cfg.Concurrency = 4, 2
	e.start(hostileRegistry(t, runs), cfg)
	replyTo, replies := e.replyQueue()
	hs := hostiles()
	const n = 40
	for i := range n {
		e.publishHostile(hs[i%len(hs)].msg(taskID(i), replyTo))
	}
	e.publish(&celeryproto.Message{Protocol: 2, Task: "h.add", ID: taskID(99), Args: []any{int64(20), int64(22)}, ReplyTo: replyTo, CorrelationID: taskID(99)})
	deadline := time.After(60 * time.Second)
	for answered := false; !answered; {
		select {
		case r := <-replies:
			answered = r["task_id"] == taskID(99)
		case <-deadline:
			t.Fatalf("the normal task behind %d refused ones was not answered in 60s (ran %d of them)", n, len(runs.snapshot()))
		}
	}
	testkit.WaitFor(t, "queue empty", 20*time.Second, func() bool { return e.queueDepth(e.queue) == 0 })
	for id, c := range runs.snapshot() {
		if c != 1 {
			t.Errorf("task %.40s ran %d times", id, c)
		}
	}
}

// TestQuarantineCopyCutToFitAFrame: a message whose headers nearly fill a
// frame (a 60 KB unknown task name and a 68 KB header) is answered and
// quarantined once, its copy's headers cut (HeaderTruncated says so) and
// its body whole; its log lines are bounded and not repeated.
func TestQuarantineCopyCutToFitAFrame(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cfg := e.config()
	core, logs := observer.New(zap.DebugLevel)
	cfg.Logger = zap.New(zapcore.NewTee(cfg.Logger.Core(), core))
	e.start(hostileRegistry(t, &effects{}), cfg)
	replyTo, replies := e.replyQueue()
	name := "h." + strings.Repeat("n", 60_000)
	body := `[[1, 2], {}, {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]`
	e.publishRaw(&celeryproto.Publishing{ContentType: "application/json", ContentEncoding: "utf-8", Body: []byte(body),
		Headers: map[string]any{"task": name, "id": taskID(1), "lang": "py", "x-big": strings.Repeat("b", 68_000)},
		ReplyTo: replyTo, CorrelationID: taskID(1)})
	var got []amqp091.Delivery
	testkit.WaitFor(t, "quarantined", 20*time.Second, func() bool {
		got = append(got, e.quarantined()...)
		return len(got) > 0
	})
	time.Sleep(3 * time.Second)
	got = append(got, e.quarantined()...)
	if len(got) != 1 {
		t.Fatalf("quarantined %d copies, want 1", len(got))
	}
	d := got[0]
	if d.Headers[HeaderReason] != ReasonUnknownTask || d.Headers["id"] != taskID(1) || string(d.Body) != body {
		t.Errorf("copy: reason %v id %v body %q", d.Headers[HeaderReason], d.Headers["id"], d.Body)
	}
	if s, _ := d.Headers["task"].(string); len(s) > maxQuarantineValue+3 || !strings.HasPrefix(name, strings.TrimSuffix(s, "...")) {
		t.Errorf("task header of %d bytes, want the name cut to %d", len(s), maxQuarantineValue)
	}
	if tr, _ := d.Headers[HeaderTruncated].(string); !strings.Contains(tr, "x-big") || !strings.Contains(tr, "task") {
		t.Errorf("%s = %q, want it to name task and x-big", HeaderTruncated, tr)
	}
	res := results(t, replies, 1, 10*time.Second)
	if r := res[taskID(1)]; len(r) != 1 || r[0]["status"] != "FAILURE" {
		t.Errorf("answered %v, want one FAILURE", r)
	}
	if n := logs.FilterMessage("quarantine publish failed; delivery kept and tried again").Len(); n != 0 {
		t.Errorf("%d failed quarantine publishes", n)
	}
	total := 0
	for _, l := range logs.All() {
		total += len(l.Message)
		for _, f := range l.Context {
			total += len(f.String) + len(fmt.Sprint(f.Interface))
		}
	}
	// The unregistered task's name is logged once where it is received.
	if total > 100_000 {
		t.Errorf("%d bytes of log for one message", total)
	}
	e.publish(&celeryproto.Message{Protocol: 2, Task: "h.add", ID: taskID(2), Args: []any{int64(20), int64(22)}, ReplyTo: replyTo, CorrelationID: taskID(2)})
	if r := results(t, replies, 1, 10*time.Second)[taskID(2)]; len(r) != 1 || fmt.Sprint(r[0]["result"]) != "42" {
		t.Errorf("the next task was answered %v, want 42", r)
	}
}
