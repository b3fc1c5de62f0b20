package tasks

import (
	"context"
	"encoding/base64"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/sqs"
)

// noteArgs are a task's order id (its key) and a note of any length.
type noteArgs struct {
	OrderID string `celery:"order_id"`
	Note    string `celery:"note"`
}

// sentTo are the SendMessage forms the fake recorded for the queue named
// name that SQS accepts (sqsRefusal).
func (f *fakeSQS) sentTo(name string) []map[string][]string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []map[string][]string
	for _, form := range f.sent {
		if u := form["QueueUrl"]; len(u) > 0 && strings.HasSuffix(u[0], "/"+name) && sqsRefusal(form) == "" {
			out = append(out, form)
		}
	}
	return out
}

// attrOf is the value of the attribute named name of a SendMessage form.
func attrOf(form map[string][]string, name string) (string, bool) {
	for _, a := range sentAttrs(form) {
		if a.name == name {
			return a.value, true
		}
	}
	return "", false
}

// TestSQSWorkerRetryRefusedQuarantined (a worker on the fake server): a
// plain message whose retry does not fit its queue's MaximumMessageSize
// (its task, task id and retries added) runs once; the refused retry
// answers the caller and quarantines the message (publish_refused), the
// body whole; with a record too (outside, same database).
func TestSQSWorkerRetryRefusedQuarantined(t *testing.T) {
	var pool = testenv.Pool(t)
	schema := testenv.Schema(t, pool)
	store, err := idempotency.New(pool, idempotency.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(store.Close)
	mctx, mcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer mcancel()
	if err := store.Migrate(mctx); err != nil {
		t.Fatal(err)
	}
	for _, mode := range []Mode{ModePure, ModeOutside, ModeSameDB} {
		t.Run(mode.String(), func(t *testing.T) {
			f := newStrictSQS(t)
			f.attrs["q"] = map[string]string{"MaximumMessageSize": "1024"}
			body := `{"order_id": "o-` + mode.String() + `", "note": "` + strings.Repeat("n", 950) + `"}`
			f.add(fakeMessage{id: "m1", body: body, attrs: map[string]string{"task": "t.later"}})
			var runs atomic.Int32
			reg := NewRegistry()
			task := Task[noteArgs]{Name: "t.later", Mode: mode}
			run := func(c *Call) (any, error) {
				runs.Add(1)
				return nil, c.Retry(time.Minute, errors.New("later"))
			}
			switch mode {
			case ModePure:
				task.Run = func(_ context.Context, c *Call, _ noteArgs) (any, error) { return run(c) }
			case ModeOutside:
				task.Key = func(a noteArgs) (string, error) { return a.OrderID, nil }
				task.Run = func(_ context.Context, c *Call, _ noteArgs) (any, error) { return run(c) }
			case ModeSameDB:
				task.Key = func(a noteArgs) (string, error) { return a.OrderID, nil }
				task.RunTx = func(_ context.Context, _ pgx.Tx, c *Call, _ noteArgs) (any, error) { return run(c) }
			}
			if err := Register(reg, task); err != nil {
				t.Fatal(err)
			}
			cfg := Config{Concurrency: 1, Prefetch: 10, Logger: zap.NewNop(), Hostname: "copies@test",
				SQS: &sqs.Config{Endpoint: f.srv.URL, Region: "us-east-1", Wait: time.Second, Credentials: aws.AnonymousCredentials{},
					Queues: []sqs.Queue{{Name: "q"}}}}
			if mode != ModePure {
				cfg.Pool, cfg.Store = pool, store
			}
			w, err := NewWorker(reg, cfg)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- w.Run(ctx) }()
			deadline := time.Now().Add(10 * time.Second)
			for len(f.sentTo("q-quarantine")) == 0 && time.Now().Before(deadline) {
				time.Sleep(50 * time.Millisecond)
			}
			time.Sleep(1500 * time.Millisecond) // a re-run would come within this
			cancel()
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			if n := runs.Load(); n != 1 {
				t.Errorf("the task ran %d times; want once", n)
			}
			if n := len(f.sentTo("q")); n != 0 {
				t.Errorf("%d retry copies sent to q; want none (over the queue's 1024 bytes)", n)
			}
			qs := f.sentTo("q-quarantine")
			if len(qs) != 1 {
				t.Fatalf("%d quarantine copies; want 1", len(qs))
			}
			if r, _ := attrOf(qs[0], HeaderReason); r != ReasonPublishRefused {
				t.Errorf("quarantine reason %q, want %q", r, ReasonPublishRefused)
			}
			if got := qs[0]["MessageBody"][0]; got != body {
				t.Errorf("quarantine copy's body is %d bytes, want the %d of the message", len(got), len(body))
			}
		})
	}
}

// TestSQSSendRefusalIsPermanent: a copy SQS refuses for what it is (here
// over SQS's size, to queues that report a larger MaximumMessageSize) is
// a refusal the pipeline's refused paths take (amqp.IsPermanent), for a
// retry and for a quarantine copy (tried again with the reason alone).
func TestSQSSendRefusalIsPermanent(t *testing.T) {
	f := newStrictSQS(t)
	f.attrs["q"] = map[string]string{"MaximumMessageSize": "1048576"}
	f.attrs["q-quarantine"] = map[string]string{"MaximumMessageSize": "1048576"}
	body := `["` + strings.Repeat("x", sqsMaxMessageSize) + `"]`
	f.add(fakeMessage{id: "m1", body: body, attrs: map[string]string{"task": "demo.add"}})
	_, ch := startSQSTransport(t, f, "q", 10)
	d := next(t, ch)
	if err := d.retry(context.Background(), nextTry(t, d), &RetryRequest{}); !amqp.IsPermanent(err) {
		t.Errorf("retry SQS refuses: %v; want a refusal (amqp.IsPermanent)", err)
	}
	err := d.quarantine(context.Background(), quarantineOurs(ReasonUnknownTask, "x", "q"))
	if !amqp.IsPermanent(err) {
		t.Errorf("quarantine copy SQS refuses: %v; want a refusal (amqp.IsPermanent)", err)
	}
	if n := len(f.sent); n != 3 {
		t.Errorf("%d sends; want 3 (the retry, the quarantine copy, the copy with the reason alone)", n)
	}
}

// TestSQSQuarantineBodyOverQuarantineLimit: a message whose body alone is
// over its quarantine queue's MaximumMessageSize (smaller than its own
// queue's) has a quarantine copy SQS takes: its body cut, as
// x-onceler-truncated says.
func TestSQSQuarantineBodyOverQuarantineLimit(t *testing.T) {
	f := newStrictSQS(t)
	f.attrs["q-quarantine"] = map[string]string{"MaximumMessageSize": "1024"}
	body := `["` + strings.Repeat("x", 2000) + `"]`
	f.add(fakeMessage{id: "m1", body: body, attrs: map[string]string{"task": "no.such.task"}})
	_, ch := startSQSTransport(t, f, "q", 10)
	d := next(t, ch)
	if err := d.quarantine(context.Background(), quarantineOurs(ReasonUnknownTask, `unknown task "no.such.task"`, "q")); err != nil {
		t.Fatal(err)
	}
	form := f.lastSent(t)
	size := len(form["MessageBody"][0])
	for _, a := range sentAttrs(form) {
		size += len(a.name) + len(a.dataType) + len(a.value)
	}
	if size > 1024 {
		t.Errorf("copy of %d bytes; the quarantine queue takes 1024", size)
	}
	if got := form["MessageBody"][0]; !strings.HasPrefix(body, got) || len(got) == 0 {
		t.Errorf("copy's body %q is not the start of the message's", got)
	}
	if note, _ := attrOf(form, HeaderTruncated); !strings.Contains(note, "body cut") {
		t.Errorf("%s = %q; want it to say the body was cut", HeaderTruncated, note)
	}
}

// TestSQSHeldKeepsBinaryAttribute: a held record of a plain message keeps
// its attributes as they came, a Binary one's bytes (not UTF-8) and data
// type included, for 'onceler resolve --retry' to send them again.
func TestSQSHeldKeepsBinaryAttribute(t *testing.T) {
	f := newStrictSQS(t)
	raw := "\x00\xff\x01trace"
	f.add(fakeMessage{id: "m1", body: "[1, 2]", attrs: map[string]string{"task": "demo.add",
		"trace": binaryMark + base64.StdEncoding.EncodeToString([]byte(raw))}})
	_, ch := startSQSTransport(t, f, "q", 10)
	d := next(t, ch)
	b, err := d.keep()
	if err != nil {
		t.Fatal(err)
	}
	queue, m, ok := DecodeHeldSQS(b)
	if !ok || queue != "q" || m.Body != "[1, 2]" {
		t.Fatalf("DecodeHeldSQS(%s) = %q, %+v, %v", b, queue, m, ok)
	}
	if m.Attributes["trace"] != raw || m.AttributeType("trace") != "Binary" {
		t.Errorf("held attribute trace: %s %q; want Binary %q", m.AttributeType("trace"), m.Attributes["trace"], raw)
	}
	if m.Attributes["task"] != "demo.add" || m.AttributeType("task") != "String" {
		t.Errorf("held attribute task: %s %q", m.AttributeType("task"), m.Attributes["task"])
	}
	_ = d.giveBack()
}

// TestSQSQuarantineCopyTenAttributesCut: a plain message whose quarantine
// copy has ten attributes and is over SQS's size with its detail goes in
// one send SQS takes: the detail cut, x-onceler-truncated among the ten,
// the attributes the worker reads kept.
func TestSQSQuarantineCopyTenAttributesCut(t *testing.T) {
	f := newStrictSQS(t)
	attrs := map[string]string{"task": "no.such.task", "idempotency_key": "k-1", "retries": "2", "app0": "v", "app1": "v"}
	body := `["` + strings.Repeat("x", sqsMaxMessageSize-600) + `"]`
	f.add(fakeMessage{id: "m1", body: body, attrs: attrs})
	_, ch := startSQSTransport(t, f, "q", 10)
	d := next(t, ch)
	if err := d.quarantine(context.Background(), quarantineOurs(ReasonUnknownTask, strings.Repeat("d", 1000), "q")); err != nil {
		t.Fatal(err)
	}
	if n := len(f.sent); n != 1 {
		t.Fatalf("%d sends (first refused: %s); want one", n, sqsRefusal(f.sent[0]))
	}
	form := f.lastSent(t)
	if got := len(sentAttrs(form)); got != sqs.MaxAttributes {
		t.Errorf("%d attributes; want %d", got, sqs.MaxAttributes)
	}
	for _, k := range []string{"task", "task_id", "idempotency_key", "retries", HeaderReason, HeaderTruncated} {
		if _, ok := attrOf(form, k); !ok {
			t.Errorf("copy has no %s (attributes %v)", k, sentAttrs(form))
		}
	}
	if detail, ok := attrOf(form, HeaderDetail); ok && len(detail) >= 1000 {
		t.Errorf("detail of %d bytes kept whole", len(detail))
	}
	if form["MessageBody"][0] != body {
		t.Error("body not kept whole")
	}
}
