package tasks

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/aws/aws-sdk-go-v2/aws"
	"go.uber.org/zap"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/sqs"
)

// SQS's limits on a message sent (SendMessage), as documented for the
// service: at most ten message attributes; at most the queue's
// MaximumMessageSize (262,144 bytes by default) counting the body and each
// attribute's name, data type and value; a body and String values of the
// characters #x9 | #xA | #xD | #x20-#xD7FF | #xE000-#xFFFD |
// #x10000-#x10FFFF only (Binary values carry any bytes).
const sqsMaxMessageSize = 262144

// sqsValidText reports whether s is text SQS accepts in a body or a String
// attribute.
func sqsValidText(s string) bool {
	if !utf8.ValidString(s) {
		return false
	}
	for _, r := range s {
		switch {
		case r == 0x9 || r == 0xA || r == 0xD:
		case r >= 0x20 && r <= 0xD7FF:
		case r >= 0xE000 && r <= 0xFFFD:
		case r >= 0x10000 && r <= 0x10FFFF:
		default:
			return false
		}
	}
	return true
}

// sentAttr is one message attribute of a SendMessage form.
type sentAttr struct {
	name, dataType, value string
}

// sentAttrs are the message attributes of a SendMessage form (a Binary
// value decoded).
func sentAttrs(form map[string][]string) []sentAttr {
	var out []sentAttr
	for i := 1; ; i++ {
		p := fmt.Sprintf("MessageAttribute.%d.", i)
		name, ok := form[p+"Name"]
		if !ok {
			return out
		}
		a := sentAttr{name: name[0]}
		if v := form[p+"Value.DataType"]; len(v) > 0 {
			a.dataType = v[0]
		}
		if v := form[p+"Value.StringValue"]; len(v) > 0 {
			a.value = v[0]
		}
		if v := form[p+"Value.BinaryValue"]; len(v) > 0 {
			b, _ := base64.StdEncoding.DecodeString(v[0])
			a.value = string(b)
		}
		out = append(out, a)
	}
}

// sqsRefusal is SQS's answer to a SendMessage form it would refuse ("":
// accepted).
func sqsRefusal(form map[string][]string) string {
	body := ""
	if v := form["MessageBody"]; len(v) > 0 {
		body = v[0]
	}
	if !sqsValidText(body) {
		return "InvalidMessageContents: Invalid binary character in the message body"
	}
	attrs := sentAttrs(form)
	if len(attrs) > sqs.MaxAttributes {
		return fmt.Sprintf("InvalidParameterValue: Number of message attributes [%d] exceeds the allowed maximum [%d].", len(attrs), sqs.MaxAttributes)
	}
	size := len(body)
	for _, a := range attrs {
		size += len(a.name) + len(a.dataType) + len(a.value)
		if a.dataType == "String" && !sqsValidText(a.value) {
			return fmt.Sprintf("InvalidParameterValue: Message attribute %s has an invalid character", a.name)
		}
	}
	if size > sqsMaxMessageSize {
		return fmt.Sprintf("InvalidParameterValue: One or more parameters are invalid. Reason: Message must be shorter than %d bytes (%d).", sqsMaxMessageSize, size)
	}
	return ""
}

// binaryMark marks a fake message's attribute value as a Binary attribute
// (the rest its bytes, base64-encoded).
const binaryMark = "base64:"

var binaryAttr = regexp.MustCompile(`<DataType>String</DataType><StringValue>` + binaryMark + `([^<]*)</StringValue>`)

// newStrictSQS is fakeSQS that refuses, as SQS does, a SendMessage over
// SQS's limits (sqsRefusal; the refused form is still recorded), and that
// hands out an attribute whose value starts with binaryMark as a Binary
// attribute.
func newStrictSQS(t *testing.T) *fakeSQS {
	f := &fakeSQS{batches: map[string]int{}, attrs: map[string]map[string]string{}}
	f.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_ = r.ParseForm()
		switch r.Form.Get("Action") {
		case "SendMessage":
			if why := sqsRefusal(r.Form); why != "" {
				f.mu.Lock()
				f.calls = append(f.calls, "SendMessage")
				f.sent = append(f.sent, r.Form)
				f.mu.Unlock()
				code, msg, _ := strings.Cut(why, ": ")
				w.Header().Set("Content-Type", "text/xml")
				w.WriteHeader(http.StatusBadRequest)
				fmt.Fprintf(w, `<ErrorResponse><Error><Type>Sender</Type><Code>%s</Code><Message>%s</Message></Error></ErrorResponse>`, code, msg)
				return
			}
		case "ReceiveMessage":
			rec := httptest.NewRecorder()
			f.serve(rec, r)
			for k, v := range rec.Header() {
				w.Header()[k] = v
			}
			w.WriteHeader(rec.Code)
			_, _ = w.Write(binaryAttr.ReplaceAll(rec.Body.Bytes(), []byte(`<DataType>Binary</DataType><BinaryValue>$1</BinaryValue>`)))
			return
		}
		f.serve(w, r)
	}))
	t.Cleanup(f.srv.Close)
	return f
}

// lastSent is the last SendMessage form the fake recorded.
func (f *fakeSQS) lastSent(t *testing.T) map[string][]string {
	t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.sent) == 0 {
		t.Fatal("nothing sent")
	}
	return f.sent[len(f.sent)-1]
}

// quarantineOurs are the values the worker's quarantine gives a delivery
// (Worker.quarantine).
func quarantineOurs(reason, detail, queue string) map[string]any {
	return map[string]any{HeaderReason: reason, HeaderDetail: detail, HeaderQueue: queue,
		HeaderTime: time.Now().UTC().Format(time.RFC3339Nano)}
}

// TestSQSQuarantineCopyFitsMessageSize: a plain message within SQS's size
// limit (body and attributes) whose task is unknown has a quarantine copy
// SQS accepts: the reason attributes added to a message near the limit
// must not push the copy over it (SQS refuses it, and the worker keeps the
// delivery and tries the quarantine again for ever).
func TestSQSQuarantineCopyFitsMessageSize(t *testing.T) {
	f := newStrictSQS(t)
	body := `["` + strings.Repeat("x", sqsMaxMessageSize-200) + `"]`
	f.add(fakeMessage{id: "big", body: body, attrs: map[string]string{"task": "no.such.task"}})
	if why := sqsRefusal(map[string][]string{"MessageBody": {body}, "MessageAttribute.1.Name": {"task"},
		"MessageAttribute.1.Value.DataType": {"String"}, "MessageAttribute.1.Value.StringValue": {"no.such.task"}}); why != "" {
		t.Fatalf("the original message itself is over SQS's limits: %s", why)
	}
	_, ch := startSQSTransport(t, f, "q", 10)
	d := next(t, ch)
	err := d.quarantine(context.Background(), quarantineOurs(ReasonUnknownTask, `unknown task "no.such.task"`, "q"))
	if err != nil {
		t.Fatalf("quarantine copy of a %d-byte message refused: %v", len(body), err)
	}
}

// TestSQSRetryCopyAttributeLimit: a plain message with SQS's ten message
// attributes (its task and nine of the producer's) can be retried: the
// copy keeps within SQS's ten attributes (task_id and retries added to
// ten give twelve, which SQS refuses).
func TestSQSRetryCopyAttributeLimit(t *testing.T) {
	f := newStrictSQS(t)
	attrs := tenAttributes()
	f.add(fakeMessage{id: "m1", body: "[1, 2]", attrs: attrs})
	_, ch := startSQSTransport(t, f, "q", 10)
	d := next(t, ch)
	nxt := nextTry(t, d)
	nxt.ETA = time.Now().Add(time.Second)
	if err := d.retry(context.Background(), nxt, &RetryRequest{Countdown: time.Second}); err != nil {
		t.Fatalf("retry of a plain message with %d attributes: %v (sent %d attributes)", len(attrs), err, len(sentAttrs(f.lastSent(t))))
	}
}

// TestSQSRepublishCopyAttributeLimit: a plain message with SQS's ten
// message attributes, none of them task_id, held past Config.MaxHold can
// be republished: the copy keeps within SQS's ten attributes (task_id
// added gives eleven, which SQS refuses).
func TestSQSRepublishCopyAttributeLimit(t *testing.T) {
	f := newStrictSQS(t)
	attrs := tenAttributes()
	f.add(fakeMessage{id: "m1", body: "[1, 2]", attrs: attrs})
	_, ch := startSQSTransport(t, f, "q", 10)
	d := next(t, ch)
	if err := d.republish(context.Background(), time.Now().Add(time.Hour)); err != nil {
		t.Fatalf("republish of a plain message with %d attributes: %v (sent %d attributes)", len(attrs), err, len(sentAttrs(f.lastSent(t))))
	}
}

// TestSQSCopyKeepsBinaryAttribute: a plain message with a Binary message
// attribute (any bytes) has copies (here its quarantine copy) that SQS
// accepts and that keep the attribute as it came: Binary, the same bytes
// (sent as a String attribute, bytes such as NUL are invalid characters
// and SQS refuses the copy).
func TestSQSCopyKeepsBinaryAttribute(t *testing.T) {
	f := newStrictSQS(t)
	raw := "\x00\xff\x01trace"
	f.add(fakeMessage{id: "m1", body: "[1]", attrs: map[string]string{"task": "no.such.task",
		"trace": binaryMark + base64.StdEncoding.EncodeToString([]byte(raw))}})
	_, ch := startSQSTransport(t, f, "q", 10)
	d := next(t, ch)
	qerr := d.quarantine(context.Background(), quarantineOurs(ReasonUnknownTask, `unknown task "no.such.task"`, "q"))
	var got *sentAttr
	for _, a := range sentAttrs(f.lastSent(t)) {
		if a.name == "trace" {
			got = &a
		}
	}
	switch {
	case qerr != nil:
		t.Errorf("quarantine copy of a message with a Binary attribute refused: %v", qerr)
	case got == nil:
		t.Errorf("quarantine copy lost the Binary attribute")
	}
	if got != nil && (got.dataType != "Binary" || got.value != raw) {
		t.Errorf("copy's attribute trace: %s %q; want Binary %q", got.dataType, got.value, raw)
	}
}

// TestSQSWirePlainKwargsNamedBody: a plain message of keyword arguments is
// read as such whatever the arguments are named: an object with "body"
// and "properties" keys is a task's keyword arguments body= and
// properties=, not kombu's envelope, when it is not an envelope Celery
// could have written (its body not a string of a Celery message).
func TestSQSWirePlainKwargsNamedBody(t *testing.T) {
	q := &sqsQueue{Queue: sqs.Queue{Name: "q", Task: "cms.page.render"}}
	body := `{"body": "<p>hello</p>", "properties": {"title": "Home"}}`
	w, kombu := sqsWire(q, sqs.Message{ID: "mid", Body: body, ReceiveCount: 1})
	m, err := celeryproto.Decode(w)
	if err != nil || kombu {
		t.Fatalf("plain keyword arguments %s: kombu %v, decode error %v; want the task's keyword arguments", body, kombu, err)
	}
	if m.Task != "cms.page.render" || len(m.Kwargs) != 2 {
		t.Errorf("decoded %+v", m)
	}
}

// TestSQSStopHandsBackWaitingFIFO: a stopped worker makes the messages
// that did not run visible again at once, those of a FIFO group waiting
// behind a message still running when consuming stopped included: once
// that message is acked in the grace period, the next of its group is
// handed back, not left invisible until its visibility timeout runs out.
func TestSQSStopHandsBackWaitingFIFO(t *testing.T) {
	f := newFakeSQS(t)
	f.attrs["q.fifo"] = map[string]string{"VisibilityTimeout": "30"}
	f.add(fakeMessage{id: "a1", body: "[1, 2]", group: "a"}, fakeMessage{id: "a2", body: "[3, 4]", group: "a"})
	cfg := &Config{Prefetch: 10, SQS: &sqs.Config{Endpoint: f.srv.URL, Region: "us-east-1", Wait: time.Second,
		Credentials: aws.AnonymousCredentials{}, Queues: []sqs.Queue{{Name: "q.fifo", Task: "demo.add"}}}}
	tr := newSQSTransport(cfg, zap.NewNop())
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := tr.prepare(ctx); err != nil {
		t.Fatal(err)
	}
	ch := make(chan delivery, 100)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = tr.consume(ctx, func(d delivery) { ch <- d })
	}()
	a1 := next(t, ch)
	if a1.m.ID != "a1" {
		t.Fatalf("first delivery %s, want a1", a1.m.ID)
	}
	// Wait until a2 has been received (it waits behind a1).
	deadline := time.Now().Add(5 * time.Second)
	for {
		tr.mu.Lock()
		waiting := len(tr.groups[a1.groupKey()])
		tr.mu.Unlock()
		if waiting == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("a2 not received behind a1")
		}
		time.Sleep(10 * time.Millisecond)
	}
	// The worker stops: consuming ends while a1 runs; a1 completes in the
	// grace period and is acked; then the transport is closed.
	cancel()
	<-done
	if err := a1.ack(); err != nil {
		t.Fatal(err)
	}
	select {
	case d := <-ch:
		t.Errorf("delivery %s handed to the pipeline after consuming stopped", d.(*sqsDelivery).m.ID)
	default:
	}
	if err := tr.close(); err != nil {
		t.Fatal(err)
	}
	_, vis, dels := f.recorded()
	if !strings.Contains(strings.Join(vis, " "), "rh-a2=0") {
		t.Errorf("after the stop: visibility changes %v, deletes %v; want a2 handed back (rh-a2=0), not left in flight for its 30 s timeout", vis, dels)
	}
}

// TestSQSWorkerRetryRefusedRunsOnce (a worker on the fake server, which
// refuses what SQS refuses): a task of a plain message with SQS's ten
// message attributes that asks for a retry in a minute runs once in the
// next few seconds, whatever becomes of the retry's copy: a copy SQS
// refuses (twelve attributes) must not have the task run again and again
// without the countdown, its retries never counted.
func TestSQSWorkerRetryRefusedRunsOnce(t *testing.T) {
	f := newStrictSQS(t)
	attrs := map[string]string{"task": "t.retry_later"}
	for i := range 9 {
		attrs[fmt.Sprintf("trace%d", i)] = "v"
	}
	f.add(fakeMessage{id: "m1", body: "[1, 2]", attrs: attrs})
	var runs atomic.Int32
	reg := NewRegistry()
	if err := Register(reg, Task[addArgs]{Name: "t.retry_later", Run: func(_ context.Context, c *Call, _ addArgs) (any, error) {
		runs.Add(1)
		return nil, c.Retry(time.Minute, errors.New("later"))
	}}); err != nil {
		t.Fatal(err)
	}
	w, err := NewWorker(reg, Config{Concurrency: 1, Prefetch: 10, Logger: zap.NewNop(), Hostname: "edges@test",
		SQS: &sqs.Config{Endpoint: f.srv.URL, Region: "us-east-1", Wait: time.Second, Credentials: aws.AnonymousCredentials{},
			Queues: []sqs.Queue{{Name: "q"}}}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	time.Sleep(6 * time.Second)
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	f.mu.Lock()
	sends := len(f.sent)
	f.mu.Unlock()
	if n := runs.Load(); n != 1 {
		t.Errorf("the task ran %d times in 6 s (retry asked with a 1-minute countdown; %d retry copies sent and refused); want once", n, sends)
	}
}

// TestSQSQuarantineKeepsIdempotencyKey: the quarantine copy of a plain
// message keeps the attributes the worker reads (idempotency_key,
// retries) ahead of the producer's others: 'onceler quarantine requeue'
// sends the copy's attributes back, and a message requeued without its
// idempotency_key is another operation to the record (its key from the
// task's Key function), which runs the effect again if the producer's
// other message of that key has run.
func TestSQSQuarantineKeepsIdempotencyKey(t *testing.T) {
	f := newStrictSQS(t)
	attrs := map[string]string{"task": "no.such.task", "idempotency_key": "payment-42", "retries": "1"}
	for i := range 5 {
		attrs[fmt.Sprintf("app%d", i)] = "v"
	}
	f.add(fakeMessage{id: "m1", body: "[1, 2]", attrs: attrs})
	_, ch := startSQSTransport(t, f, "q", 10)
	d := next(t, ch)
	if err := d.quarantine(context.Background(), quarantineOurs(ReasonUnknownTask, `unknown task "no.such.task"`, "q")); err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, a := range sentAttrs(f.lastSent(t)) {
		got[a.name] = a.value
	}
	for _, k := range []string{"idempotency_key", "retries"} {
		if got[k] != attrs[k] {
			t.Errorf("quarantine copy's %s = %q, want %q (copy's attributes: %v)", k, got[k], attrs[k], got)
		}
	}
}

// tenAttributes is a plain message's attributes at SQS's limit of ten: its
// task and nine of the producer's.
func tenAttributes() map[string]string {
	attrs := map[string]string{"task": "demo.add"}
	for i := range 9 {
		attrs[fmt.Sprintf("trace%d", i)] = "v"
	}
	return attrs
}

// nextTry is the message of d, decoded, as its retry sends it: one more
// try.
func nextTry(t *testing.T, d delivery) *celeryproto.Message {
	t.Helper()
	msg, err := celeryproto.Decode(d.wire())
	if err != nil {
		t.Fatal(err)
	}
	nxt := *msg
	nxt.Retries++
	return &nxt
}

// TestSQSReceiveFailuresCounted: receives SQS answers with an error are
// tried again, counted in onceler_receive_failures_total, and the message
// waiting behind them is still delivered.
func TestSQSReceiveFailuresCounted(t *testing.T) {
	f := newFakeSQS(t)
	f.mu.Lock()
	f.failReceives = 2
	f.mu.Unlock()
	f.add(fakeMessage{id: "m1", body: `{"args": [1, 2]}`})
	m, err := newMetrics(nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	_, ch := startSQSTransportWith(t, f, "q", 4, func(tr *sqsTransport) { tr.failed = m.recvFails.Inc })
	if d := next(t, ch); d.m.ID != "m1" {
		t.Fatalf("delivered %q, want m1", d.m.ID)
	}
	if got := counterValue(m.recvFails); got != 2 {
		t.Fatalf("onceler_receive_failures_total = %v, want 2", got)
	}
}
