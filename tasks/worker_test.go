package tasks

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/pause"
	"github.com/onceler/onceler/internal/testkit"
)

type addArgs struct {
	X, Y int64
}

type payArgs struct {
	OrderID string `celery:"order_id"`
	Amount  int64  `celery:"amount"`
}

// effects counts the effects of outside-mode test tasks, per operation.
type effects struct {
	mu sync.Mutex
	n  map[string]int
}

func (e *effects) add(key string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.n == nil {
		e.n = make(map[string]int)
	}
	e.n[key]++
}

func (e *effects) snapshot() map[string]int {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make(map[string]int, len(e.n))
	for k, v := range e.n {
		out[k] = v
	}
	return out
}

func testRegistry(t *testing.T, fx *effects) *Registry {
	t.Helper()
	r := NewRegistry()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(Register(r, Task[addArgs]{Name: "t.add", Run: func(_ context.Context, _ *Call, a addArgs) (any, error) {
		return a.X + a.Y, nil
	}}))
	must(Register(r, Task[addArgs]{Name: "t.fail_value", Run: func(context.Context, *Call, addArgs) (any, error) {
		return nil, ValueError("x must be positive")
	}}))
	must(Register(r, Task[addArgs]{Name: "t.fail_key", Run: func(context.Context, *Call, addArgs) (any, error) {
		return nil, KeyError("no such account")
	}}))
	must(Register(r, Task[addArgs]{Name: "t.fail_plain", Run: func(context.Context, *Call, addArgs) (any, error) {
		return nil, errors.New("disk on fire")
	}}))
	must(Register(r, Task[addArgs]{Name: "t.panic", Run: func(context.Context, *Call, addArgs) (any, error) {
		panic("kaboom")
	}}))
	for name, d := range map[string]time.Duration{"t.pay": 0, "t.pay_slow": 10 * time.Millisecond,
		"t.pay_slower": 40 * time.Millisecond} {
		must(Register(r, Task[payArgs]{
			Name: name, Mode: ModeOutside, Policy: PolicyRetry,
			Key: func(a payArgs) (string, error) { return a.OrderID, nil },
			Run: func(ctx context.Context, c *Call, a payArgs) (any, error) {
				if !pause.For(ctx, d) {
					return nil, context.Cause(ctx)
				}
				fx.add(c.Key)
				return map[string]any{"order": a.OrderID, "charged": a.Amount, "ref": c.Reference}, nil
			},
		}))
	}
	return r
}

// TestPythonCeleryEndToEnd: real Celery 5.2.6 sends tasks and waits on
// AsyncResult.get(); results and chosen exception classes come back, with
// protocols 1 and 2 and the json and msgpack serializers.
func TestPythonCeleryEndToEnd(t *testing.T) {
	e := newEnv(t)
	fx := &effects{}
	e.start(testRegistry(t, fx), e.config())

	for _, tc := range []struct {
		protocol   int
		serializer string
	}{{2, "json"}, {1, "json"}, {2, "msgpack"}} {
		t.Run(fmt.Sprintf("protocol%d_%s", tc.protocol, tc.serializer), func(t *testing.T) {
			order := "o-" + tc.serializer + fmt.Sprint(tc.protocol)
			res := e.python(tc.protocol, tc.serializer,
				pyCall{Task: "t.add", Args: []any{2, 40}},
				pyCall{Task: "t.add", Args: []any{1}, Kwargs: map[string]any{"y": 9}},
				pyCall{Task: "t.fail_value", Args: []any{1, 2}},
				pyCall{Task: "t.fail_key", Args: []any{1, 2}},
				pyCall{Task: "t.fail_plain", Args: []any{1, 2}},
				pyCall{Task: "t.panic", Args: []any{1, 2}},
				pyCall{Task: "t.pay", Kwargs: map[string]any{"order_id": order, "amount": 700}},
				pyCall{Task: "t.pay", Kwargs: map[string]any{"order_id": order, "amount": 700}},
			)
			wantOK := func(i int, want string) {
				t.Helper()
				if res[i].ExcType != "" || string(res[i].OK) != want {
					t.Errorf("call %d: got %+v, want result %s", i, res[i], want)
				}
			}
			wantExc := func(i int, typ, msg string) {
				t.Helper()
				if res[i].ExcType != typ || !strings.Contains(res[i].Message, msg) {
					t.Errorf("call %d: got %+v, want %s(%q)", i, res[i], typ, msg)
				}
			}
			wantOK(0, "42")
			wantOK(1, "10")
			wantExc(2, "ValueError", "x must be positive")
			wantExc(3, "KeyError", "no such account")
			wantExc(4, "Exception", "disk on fire")
			wantExc(5, "Exception", "kaboom")
			want := fmt.Sprintf(`{"charged": 700, "order": %q, "ref": "t.pay:%s"}`, order, order)
			wantOK(6, want)
			wantOK(7, want) // the duplicate gets the stored result
			if n := fx.snapshot()[order]; n != 1 {
				t.Errorf("operation %s ran %d times, want 1", order, n)
			}
		})
	}
	if d := e.queueDepth(e.queue); d != 0 {
		t.Errorf("queue holds %d messages after the run", d)
	}
}

// TestQuarantine: garbage, pickle, unknown task, bad arguments and a
// fingerprint mismatch each end in the quarantine queue with their reason,
// the unknown task's caller gets NotRegistered, and the worker keeps serving.
func TestQuarantine(t *testing.T) {
	e := newEnv(t)
	fx := &effects{}
	r := e.start(testRegistry(t, fx), e.config())

	e.publishRaw(&celeryproto.Publishing{ContentType: "application/json", ContentEncoding: "utf-8",
		Body: []byte("{not json"), Headers: map[string]any{"task": "t.add", "id": taskID(1), "lang": "py"}})
	e.publishRaw(&celeryproto.Publishing{ContentType: "application/x-python-serialize", ContentEncoding: "binary",
		Body: []byte("\x80\x04\x95garbage."), Headers: map[string]any{"task": "t.add", "id": taskID(2), "lang": "py"}})

	res := e.python(2, "json",
		pyCall{Task: "t.nope", Args: []any{1}},
		pyCall{Task: "t.add", Args: []any{1, "two"}},
		pyCall{Task: "t.add", Args: []any{1, 2, 3}},
		pyCall{Task: "t.pay", Kwargs: map[string]any{"order_id": "m-1", "amount": 5}},
		// Sent once the first pay is answered: with several task goroutines
		// the second could otherwise be claimed first.
		pyCall{Task: "t.pay", Kwargs: map[string]any{"order_id": "m-1", "amount": 6}, AfterPrevious: true},
		pyCall{Task: "t.add", Args: []any{20, 22}},
	)
	if res[0].ExcType != "NotRegistered" || res[0].Message != "t.nope" {
		t.Errorf("unknown task: got %+v, want NotRegistered", res[0])
	}
	if res[1].ExcType != "TypeError" || !strings.Contains(res[1].Message, "argument y: expected int64, got str") {
		t.Errorf("bad argument type: got %+v", res[1])
	}
	if res[2].ExcType != "TypeError" || !strings.Contains(res[2].Message, "takes 2 positional arguments but 3 were given") {
		t.Errorf("too many arguments: got %+v", res[2])
	}
	if res[3].ExcType != "" {
		t.Errorf("first pay: %+v", res[3])
	}
	if res[4].ExcType != "ValueError" || !strings.Contains(res[4].Message, "different arguments") {
		t.Errorf("mismatch: got %+v", res[4])
	}
	if string(res[5].OK) != "42" {
		t.Errorf("worker stopped serving: %+v", res[5])
	}

	var got []amqp091Delivery
	testkit.WaitFor(t, "5 quarantined messages", 10*time.Second, func() bool {
		for _, d := range e.quarantined() {
			got = append(got, amqp091Delivery{reason: fmt.Sprint(d.Headers[HeaderReason]),
				detail: fmt.Sprint(d.Headers[HeaderDetail]), queue: fmt.Sprint(d.Headers[HeaderQueue]),
				body: string(d.Body), contentType: d.ContentType})
		}
		return len(got) >= 5
	})
	reasons := map[string]int{}
	for _, d := range got {
		reasons[d.reason]++
		if d.queue != e.queue {
			t.Errorf("quarantined message names queue %q", d.queue)
		}
		t.Logf("quarantined: reason=%s detail=%s", d.reason, d.detail)
	}
	want := map[string]int{ReasonUndecodable: 2, ReasonUnknownTask: 1, ReasonBadArguments: 2, ReasonMismatch: 1}
	for reason, n := range want {
		if reasons[reason] != n {
			t.Errorf("quarantine reason %s: %d messages, want %d (all: %v)", reason, reasons[reason], n, reasons)
		}
		if c := counter(r.w.m.quarantined.WithLabelValues(reason)); c != float64(n) {
			t.Errorf("onceler_quarantined_total{reason=%q} = %v, want %d", reason, c, n)
		}
	}
	for _, d := range got {
		if d.contentType == "application/x-python-serialize" && (d.body != "\x80\x04\x95garbage." || !strings.Contains(d.detail, "pickle")) {
			t.Errorf("pickle message not kept as sent: %+v", d)
		}
	}
	if n := fx.snapshot()["m-1"]; n != 1 {
		t.Errorf("m-1 ran %d times", n)
	}
	if d := e.queueDepth(e.queue); d != 0 {
		t.Errorf("queue holds %d messages", d)
	}
}

type amqp091Delivery struct{ reason, detail, queue, body, contentType string }

// TestUndecodableCallerAnswered: a body that cannot be read, or pickle, is
// quarantined unread, and a caller named by the message's id header and
// reply_to hears why (ContentDisallowed or DecodeError, as kombu raises).
func TestUndecodableCallerAnswered(t *testing.T) {
	e := newEnv(t)
	e.start(testRegistry(t, &effects{}), e.config())
	replyTo, replies := e.replyQueue()
	e.publishRaw(&celeryproto.Publishing{ContentType: "application/x-python-serialize", ContentEncoding: "binary",
		Body: []byte("\x80\x04\x95garbage."), Headers: map[string]any{"task": "t.add", "id": taskID(1), "lang": "py"},
		ReplyTo: replyTo, CorrelationID: taskID(1)})
	e.publishRaw(&celeryproto.Publishing{ContentType: "application/json", ContentEncoding: "utf-8",
		Body: []byte("{not json"), Headers: map[string]any{"task": "t.add", "id": taskID(2), "lang": "py"},
		ReplyTo: replyTo, CorrelationID: taskID(2)})
	res := results(t, replies, 2, 10*time.Second)
	for id, want := range map[string]string{taskID(1): "ContentDisallowed", taskID(2): "DecodeError"} {
		r := res[id]
		if len(r) != 1 || r[0]["status"] != "FAILURE" {
			t.Errorf("%s: answered %v, want one FAILURE %s", id, r, want)
			continue
		}
		if exc, _ := r[0]["result"].(map[string]any); exc["exc_type"] != want || exc["exc_module"] != "kombu.exceptions" {
			t.Errorf("%s: %v, want kombu.exceptions.%s", id, exc, want)
		}
	}
	// The same from a real Celery caller that sends pickle.
	if r := e.python(2, "pickle", pyCall{Task: "t.add", Args: []any{1, 2}}); r[0].ExcType != "ContentDisallowed" || r[0].ExcModule != "kombu.exceptions" {
		t.Errorf("pickle from Celery: %+v, want kombu.exceptions.ContentDisallowed", r[0])
	}
	var got []amqp091.Delivery
	testkit.WaitFor(t, "all three in quarantine", 10*time.Second, func() bool {
		got = append(got, e.quarantined()...)
		return len(got) >= 3
	})
	for _, d := range got {
		if d.Headers[HeaderReason] != ReasonUndecodable {
			t.Errorf("quarantined %v as %v", d.Headers["id"], d.Headers[HeaderReason])
		}
	}
}

// TestBadInputIsQuarantinedNotRetried: input the record cannot keep (NUL
// or invalid UTF-8 in the operation key or the task id), a retries count
// out of range, and names so long that the quarantine copy's detail would
// not fit a frame: each message is answered and quarantined, once, rather
// than retried for ever as if the database or the broker were down, and
// the worker keeps serving.
func TestBadInputIsQuarantinedNotRetried(t *testing.T) {
	e := newEnv(t)
	e.start(testRegistry(t, &effects{}), e.config())
	replyTo, replies := e.replyQueue()
	cases := []struct {
		task, id, body string
		retries        any
		reason         string
	}{
		{"t.pay", taskID(1), `[[], {"order_id": "o\u0000x", "amount": 5}, {}]`, nil, ReasonBadArguments},
		{"t.pay", taskID(2), "[[], {\"order_id\": \"o\xffx\", \"amount\": 5}, {}]", nil, ReasonBadArguments},
		{"t.pay", "id\x00x", `[[], {"order_id": "fine-1", "amount": 5}, {}]`, nil, ReasonUndecodable},
		{"t.add", taskID(4), `[[1, 2], {}, {}]`, int64(-1), ReasonUndecodable},
		{"t." + strings.Repeat("x", 90_000), taskID(5), `[[1, 2], {}, {}]`, nil, ReasonUnknownTask},
		{"t.add", taskID(6), `[[1, 2], {"` + strings.Repeat("k", 200_000) + `": 1}, {}]`, nil, ReasonBadArguments},
	}
	for _, c := range cases {
		h := map[string]any{"task": c.task, "id": c.id, "lang": "py"}
		if c.retries != nil {
			h["retries"] = c.retries
		}
		e.publishRaw(&celeryproto.Publishing{ContentType: "application/json", ContentEncoding: "utf-8",
			Body: []byte(c.body), Headers: h, ReplyTo: replyTo, CorrelationID: c.id})
	}
	var got []amqp091.Delivery
	testkit.WaitFor(t, "all in quarantine", 20*time.Second, func() bool {
		got = append(got, e.quarantined()...)
		return len(got) >= len(cases)
	})
	reasons := map[string]int{}
	for _, d := range got {
		reasons[fmt.Sprint(d.Headers[HeaderReason])]++
		if n := len(fmt.Sprint(d.Headers[HeaderDetail])); n > maxDetail+3 {
			t.Errorf("detail of %d bytes", n)
		}
	}
	want := map[string]int{}
	for _, c := range cases {
		want[c.reason]++
	}
	if fmt.Sprint(reasons) != fmt.Sprint(want) {
		t.Errorf("quarantined by reason %v, want %v", reasons, want)
	}
	// Every caller that can be named heard of it (the one whose id is not
	// text is named by its correlation id, the same bytes).
	res := results(t, replies, len(cases), 10*time.Second)
	for _, c := range cases {
		if r := res[c.id]; len(r) != 1 || r[0]["status"] != "FAILURE" {
			t.Errorf("%.40q: answered %v, want one FAILURE", c.task, r)
		}
	}
	e.publish(&celeryproto.Message{Protocol: 2, Task: "t.add", ID: taskID(9), Args: []any{int64(20), int64(22)}, ReplyTo: replyTo, CorrelationID: taskID(9)})
	if r := results(t, replies, 1, 10*time.Second)[taskID(9)]; len(r) != 1 || fmt.Sprint(r[0]["result"]) != "42" {
		t.Errorf("worker stopped serving: %v", r)
	}
}

// TestQuarantineRetry: when the move to the quarantine queue fails (here
// the queue is missing for a moment, so the mandatory publish comes back),
// the delivery is kept and moved again later, still as refused: not run, not
// answered twice, not claimed, and the worker keeps serving.
func TestQuarantineRetry(t *testing.T) {
	for _, tc := range []struct {
		name   string
		msg    func(replyTo string) *celeryproto.Message
		reason string
	}{
		{"bad arguments of a pure task", func(replyTo string) *celeryproto.Message {
			return &celeryproto.Message{Protocol: 2, Task: "t.add", ID: taskID(1), Args: []any{"not", "numbers"}, ReplyTo: replyTo, CorrelationID: taskID(1)}
		}, ReasonBadArguments},
		{"unknown task", func(replyTo string) *celeryproto.Message {
			return &celeryproto.Message{Protocol: 2, Task: "t.no_such_task", ID: taskID(1), ReplyTo: replyTo, CorrelationID: taskID(1)}
		}, ReasonUnknownTask},
		{"bad arguments of an outside task", func(replyTo string) *celeryproto.Message {
			return &celeryproto.Message{Protocol: 2, Task: "t.pay", ID: taskID(1), Kwargs: map[string]any{"order_id": "o-1"}, ReplyTo: replyTo, CorrelationID: taskID(1)}
		}, ReasonBadArguments},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			fx := &effects{}
			cfg := e.config()
			core, logs := observer.New(zap.WarnLevel)
			cfg.Logger = zap.New(zapcore.NewTee(cfg.Logger.Core(), core))
			e.start(testRegistry(t, fx), cfg)
			replyTo, replies := e.replyQueue()
			q := quarantineName(e.queue)
			if _, err := e.ch.QueueDelete(q, false, false, false); err != nil {
				t.Fatal(err)
			}
			e.publish(tc.msg(replyTo))
			testkit.WaitFor(t, "a failed quarantine publish", 10*time.Second, func() bool {
				return logs.FilterMessage("quarantine publish failed; delivery kept and tried again").Len() > 0
			})
			if _, err := e.ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
				t.Fatal(err)
			}
			var got []amqp091.Delivery
			testkit.WaitFor(t, "the message in quarantine", 15*time.Second, func() bool {
				got = append(got, e.quarantined()...)
				return len(got) > 0
			})
			if r := fmt.Sprint(got[0].Headers[HeaderReason]); len(got) != 1 || r != tc.reason {
				t.Errorf("quarantined %d messages, reason %s; want 1, %s", len(got), r, tc.reason)
			}
			// The same check as the rest of the queue's traffic: one more
			// message goes through, so any second answer to the first
			// would be in by then.
			e.publish(&celeryproto.Message{Protocol: 2, Task: "t.add", ID: taskID(2), Args: []any{int64(20), int64(22)}, ReplyTo: replyTo, CorrelationID: taskID(2)})
			res := results(t, replies, 2, 10*time.Second)
			if r := res[taskID(1)]; len(r) != 1 || r[0]["status"] != "FAILURE" {
				t.Errorf("refused message answered %v, want one FAILURE", r)
			}
			if r := res[taskID(2)]; len(r) != 1 || fmt.Sprint(r[0]["result"]) != "42" {
				t.Errorf("next message answered %v, want 42", r)
			}
			if n := len(fx.snapshot()); n != 0 {
				t.Errorf("%d effects, want none", n)
			}
			if d := e.queueDepth(e.queue); d != 0 {
				t.Errorf("queue holds %d messages", d)
			}
		})
	}
}

// results collects n results from a reply channel, by task id.
func results(t *testing.T, replies <-chan map[string]any, n int, timeout time.Duration) map[string][]map[string]any {
	t.Helper()
	out := collect(replies, n, timeout)
	got := 0
	for _, rs := range out {
		got += len(rs)
	}
	if got < n {
		t.Fatalf("got %d of %d results in %s", got, n, timeout)
	}
	return out
}

func payMessage(task string, i int, order string, replyTo string) *celeryproto.Message {
	return &celeryproto.Message{Protocol: 2, Task: task, ID: taskID(i), Kwargs: map[string]any{"order_id": order, "amount": int64(100)},
		ReplyTo: replyTo, CorrelationID: taskID(i), RootID: taskID(i)}
}

func checkPay(t *testing.T, res map[string][]map[string]any, ids int, keyOf func(i int) string) {
	t.Helper()
	for i := range ids {
		rs := res[taskID(i)]
		if len(rs) == 0 {
			t.Errorf("task %d: no result", i)
			continue
		}
		r := rs[0]
		if r["status"] != "SUCCESS" {
			t.Errorf("task %d: %v", i, r)
			continue
		}
		m, _ := r["result"].(map[string]any)
		if m["order"] != keyOf(i) {
			t.Errorf("task %d: result %v", i, r["result"])
		}
	}
}

// TestDuplicatesTwoWorkers: two workers on one queue, 2,000 messages over
// 500 operation keys (each 4×, interleaved): exactly 500 effects, 2,000
// results, and the record's repeats report counts 1,500 duplicates.
func TestDuplicatesTwoWorkers(t *testing.T) {
	e := newEnv(t)
	fx := &effects{}
	reg := testRegistry(t, fx)
	cfg := e.config()
	cfg.Concurrency, cfg.Prefetch = 16, 64
	since := time.Now().Add(-time.Second)
	w1 := e.start(reg, cfg)
	cfg2 := e.config()
	cfg2.Concurrency, cfg2.Prefetch = 16, 64
	w2 := e.start(reg, cfg2)

	replyTo, replies := e.replyQueue()
	const keys, repeats = 500, 4
	// The first half sends each key's first two copies back to back, so
	// that the two workers hold them at the same time; the second half
	// spreads the other two copies 500 messages apart.
	key := func(i int) string {
		if i < keys*repeats/2 {
			return fmt.Sprintf("order-%d", i/2)
		}
		return fmt.Sprintf("order-%d", i%keys)
	}
	start := time.Now()
	for i := range keys * repeats {
		e.publish(payMessage("t.pay_slow", i, key(i), replyTo))
	}
	res := results(t, replies, keys*repeats, 90*time.Second)
	t.Logf("2,000 deliveries over 2 workers in %s", time.Since(start))
	deferred := 0.0
	for _, w := range []*running{w1, w2} {
		deferred += counter(w.w.m.deferred.WithLabelValues("t.pay_slow"))
	}
	t.Logf("deliveries deferred because their operation was in progress: %v", deferred)
	checkPay(t, res, keys*repeats, key)
	fxs := fx.snapshot()
	if len(fxs) != keys {
		t.Errorf("%d operations had effects, want %d", len(fxs), keys)
	}
	for k, n := range fxs {
		if n != 1 {
			t.Errorf("operation %s: %d effects", k, n)
		}
	}
	testkit.WaitFor(t, "queue empty", 10*time.Second, func() bool { return e.queueDepth(e.queue) == 0 })
	rep, err := e.store.Repeats(context.Background(), since)
	if err != nil {
		t.Fatal(err)
	}
	var dups int64
	for _, r := range rep {
		if r.Task == "t.pay_slow" {
			dups = r.Duplicates
		}
	}
	if dups != keys*(repeats-1) {
		t.Errorf("repeats report: %d duplicates, want %d (%+v)", dups, keys*(repeats-1), rep)
	}
	// The workers' counters agree: each operation ran once, on one of them,
	// and every other delivery was answered from the record.
	ran := counter(w1.w.m.succeeded.WithLabelValues("t.pay_slow")) + counter(w2.w.m.succeeded.WithLabelValues("t.pay_slow"))
	suppressed := counter(w1.w.m.duplicates.WithLabelValues("t.pay_slow")) + counter(w2.w.m.duplicates.WithLabelValues("t.pay_slow"))
	if ran != keys || suppressed != keys*(repeats-1) {
		t.Errorf("counters: %v succeeded, %v duplicates suppressed; want %d and %d", ran, suppressed, keys, keys*(repeats-1))
	}
}

func counter(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		return -1
	}
	return m.GetCounter().GetValue()
}
