package tasks

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testkit"
)

// TestPoisonQuorum: a message redelivered more than MaxAttempts times on a
// quorum queue (x-delivery-count) is quarantined as poison, not run.
func TestPoisonQuorum(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	q := e.quorumQueue()
	fx := &effects{}
	m := payMessage("t.pay", 1, "poison-1", "")
	pub, err := encodeForTest(m)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.ch.PublishWithContext(context.Background(), "", q, false, false, pub); err != nil {
		t.Fatal(err)
	}
	// Six deliveries that end without an ack, as six crashed workers would.
	for i := 0; i < 6; {
		d, ok, err := e.ch.Get(q, false)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			time.Sleep(20 * time.Millisecond)
			continue
		}
		if err := d.Nack(false, true); err != nil {
			t.Fatal(err)
		}
		i++
	}
	cfg := e.config()
	cfg.Queues = []amqp.QueueSpec{{Name: q, Exchange: amqp.DefaultExchange, Durable: true, Quorum: true}}
	e.start(testRegistry(t, fx), cfg)
	var got []amqp091.Delivery
	testkit.WaitFor(t, "poison in quarantine", 10*time.Second, func() bool {
		d, ok, err := e.ch.Get(quarantineName(q), true)
		if err == nil && ok {
			got = append(got, d)
		}
		return len(got) == 1
	})
	if got[0].Headers[HeaderReason] != ReasonPoison {
		t.Errorf("quarantined with %v", got[0].Headers)
	}
	if n := fx.snapshot()["poison-1"]; n != 0 {
		t.Errorf("poison message ran %d times", n)
	}
}

// TestPoisonCountWaitsForARunningTransaction: a same-database operation
// still running in its transaction while the broker takes its delivery away
// (its connection closed) and hands the copies out again, more often than
// MaxAttempts: the copies wait for the run's outcome instead of being
// quarantined as poison while the run can still commit. The caller is
// answered with the result, never WorkerLostError, and the effect happens
// once.
func TestPoisonCountWaitsForARunningTransaction(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	pool := testenvPool(t)
	table := e.schema + ".slow_effects"
	if _, err := pool.Exec(ctx, `CREATE TABLE `+table+` (op text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	var started, runs atomic.Int32
	r := NewRegistry()
	if err := Register(r, Task[opArgs]{Name: "p.slow", Mode: ModeSameDB, Key: opKey,
		RunTx: func(ctx context.Context, tx pgx.Tx, _ *Call, a opArgs) (any, error) {
			runs.Add(1)
			if _, err := tx.Exec(ctx, `INSERT INTO `+table+` VALUES ($1)`, a.Op); err != nil {
				return nil, err
			}
			if started.Add(1) == 1 {
				<-release // the first run holds its transaction open
			}
			return "slow done", nil
		}}); err != nil {
		t.Fatal(err)
	}
	cfg := e.config()
	cfg.Concurrency, cfg.MaxAttempts = 8, 1
	e.start(r, cfg)
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	t.Cleanup(free) // before the worker stops, if the test fails early
	replyTo, replies := e.replyQueue()
	e.publish(&celeryproto.Message{Protocol: 2, Task: "p.slow", ID: taskID(1), Kwargs: map[string]any{"op": "op-1"},
		ReplyTo: replyTo, CorrelationID: taskID(1)})
	testkit.WaitFor(t, "the first run", 10*time.Second, func() bool { return started.Load() == 1 })
	// Take the delivery away three times: each copy comes back redelivered.
	for range 3 {
		pids := testkit.ConnectionPIDs(t, cfg.Broker.Name)
		if len(pids) == 0 {
			t.Fatal("no worker connection found")
		}
		testkit.CloseConnections(t, pids)
		time.Sleep(700 * time.Millisecond)
	}
	if q := e.quarantined(); len(q) != 0 {
		t.Fatalf("quarantined %d copies while the operation still ran: %v", len(q), q[0].Headers[HeaderReason])
	}
	free()
	res := results(t, replies, 1, 20*time.Second)
	if rs := res[taskID(1)]; rs[0]["status"] != "SUCCESS" || rs[0]["result"] != "slow done" {
		t.Errorf("answered %v", rs)
	}
	testkit.WaitFor(t, "queue empty", 10*time.Second, func() bool { return e.queueDepth(e.queue) == 0 })
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&n); err != nil || n != 1 {
		t.Errorf("%d effects (%v), want 1", n, err)
	}
}

// TestRetriedMessageNotPoison: the claims made by Celery retries do not
// count towards the poison limit of a redelivered message.
func TestRetriedMessageNotPoison(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := &effects{}
	ctx := context.Background()
	// Four earlier runs, each ending in a retry (claim, then release).
	for i := range 4 {
		p := idempotency.ClaimParams{Task: "t.pay", Key: "retried-op", Owner: "earlier", TaskID: taskID(1), Lease: time.Minute}
		c, err := e.store.Claim(ctx, p)
		if err != nil || c.Outcome != idempotency.OutcomeFirst {
			t.Fatalf("claim %d: %+v %v", i, c, err)
		}
		if err := e.store.Release(ctx, p.Ref(c.Token)); err != nil {
			t.Fatal(err)
		}
	}
	replyTo, replies := e.replyQueue()
	m := payMessage("t.pay", 1, "retried-op", replyTo)
	m.Retries = 4
	e.publish(m)
	// Deliver it once without settling, so that the worker gets it redelivered.
	for {
		d, ok, err := e.ch.Get(e.queue, false)
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			if err := d.Nack(false, true); err != nil {
				t.Fatal(err)
			}
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	cfg := e.config()
	cfg.MaxAttempts = 2
	e.start(testRegistry(t, fx), cfg)
	got := results(t, replies, 1, 10*time.Second)
	if r := got[m.ID]; len(r) != 1 || r[0]["status"] != "SUCCESS" {
		t.Fatalf("retried, redelivered message: %v", got)
	}
	if q := e.quarantined(); len(q) != 0 {
		t.Errorf("quarantined as poison: %v", q[0].Headers)
	}
	rec, err := e.store.Get(ctx, "t.pay", "retried-op")
	if err != nil || rec.Status != idempotency.StatusCompleted || rec.Attempt != 5 {
		t.Errorf("record %+v, %v (want completed at attempt 5)", rec, err)
	}
}

// TestQuarantine: garbage, pickle, unknown task, bad arguments and a
// fingerprint mismatch each end in the quarantine queue with their reason,
// the unknown task's caller gets NotRegistered, and the worker keeps serving.
func TestQuarantine(t *testing.T) {
	t.Parallel()
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
		if c := counterValue(r.w.m.quarantined.WithLabelValues(reason)); c != float64(n) {
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

// TestBadInputIsQuarantinedNotRetried: input the record cannot keep (NUL
// or invalid UTF-8 in the operation key or the task id), a retries count
// out of range, and names so long that the quarantine copy's detail would
// not fit a frame: each message is answered and quarantined, once, rather
// than retried for ever as if the database or the broker were down, and
// the worker keeps serving.
func TestBadInputIsQuarantinedNotRetried(t *testing.T) {
	t.Parallel()
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
	t.Parallel()
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
