package tasks

import (
	"context"
	"crypto/md5"
	"encoding/hex"
	"encoding/xml"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"go.uber.org/zap"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/sqs"
)

// fakeSQS is a fake SQS server that records calls: it speaks SQS's query
// protocol for the calls the transport makes, hands out the messages it is
// given (each once), and records every visibility change, delete and
// send. It stands in for what goaws (the local server of the integration
// tests) lacks: ChangeMessageVisibilityBatch, a message group id and a
// receive count on received messages, and more than one message of a FIFO
// group in one receive (as SQS returns them).
type fakeSQS struct {
	srv *httptest.Server

	mu      sync.Mutex
	queued  []fakeMessage
	calls   []string                     // actions, in order
	vis     []string                     // "handle=seconds" of each visibility change
	deletes []string                     // handles deleted
	batches map[string]int               // entries per batch call, by action (the last)
	sent    []map[string][]string        // forms of SendMessage
	attrs   map[string]map[string]string // queue attributes by name
	// failReceives is how many receives to come are refused.
	failReceives int
}

type fakeMessage struct {
	id, body, group string
	receives        int
	attrs           map[string]string
}

func newFakeSQS(t *testing.T) *fakeSQS {
	f := &fakeSQS{batches: map[string]int{}, attrs: map[string]map[string]string{}}
	f.srv = httptest.NewServer(http.HandlerFunc(f.serve))
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fakeSQS) add(ms ...fakeMessage) {
	f.mu.Lock()
	f.queued = append(f.queued, ms...)
	f.mu.Unlock()
}

func (f *fakeSQS) recorded() (calls, vis, deletes []string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.calls...), append([]string(nil), f.vis...), append([]string(nil), f.deletes...)
}

// entries are the form's entries of a batch call: prefix.N.field values.
func entries(form map[string][]string, prefix, field string) []string {
	var out []string
	for i := 1; ; i++ {
		v, ok := form[fmt.Sprintf("%s.%d.%s", prefix, i, field)]
		if !ok {
			return out
		}
		out = append(out, v[0])
	}
}

func (f *fakeSQS) serve(w http.ResponseWriter, r *http.Request) {
	_ = r.ParseForm()
	action := r.Form.Get("Action")
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, action)
	w.Header().Set("Content-Type", "text/xml")
	queueURL := f.srv.URL + "/000000000000/"
	switch action {
	case "GetQueueUrl":
		fmt.Fprintf(w, `<GetQueueUrlResponse><GetQueueUrlResult><QueueUrl>%s%s</QueueUrl></GetQueueUrlResult></GetQueueUrlResponse>`, queueURL, r.Form.Get("QueueName"))
	case "CreateQueue":
		fmt.Fprintf(w, `<CreateQueueResponse><CreateQueueResult><QueueUrl>%s%s</QueueUrl></CreateQueueResult></CreateQueueResponse>`, queueURL, r.Form.Get("QueueName"))
	case "GetQueueAttributes":
		name := r.Form.Get("QueueUrl")[strings.LastIndexByte(r.Form.Get("QueueUrl"), '/')+1:]
		var b strings.Builder
		for k, v := range f.attrs[name] {
			fmt.Fprintf(&b, `<Attribute><Name>%s</Name><Value>%s</Value></Attribute>`, k, v)
		}
		fmt.Fprintf(w, `<GetQueueAttributesResponse><GetQueueAttributesResult>%s</GetQueueAttributesResult></GetQueueAttributesResponse>`, b.String())
	case "ReceiveMessage":
		if f.failReceives > 0 {
			f.failReceives--
			// Refused, not failed on the server's side: the SDK does not
			// retry it on its own.
			w.WriteHeader(http.StatusForbidden)
			fmt.Fprint(w, `<ErrorResponse><Error><Type>Sender</Type><Code>AccessDenied</Code><Message>fake refusal</Message></Error></ErrorResponse>`)
			return
		}
		n := 1
		_, _ = fmt.Sscan(r.Form.Get("MaxNumberOfMessages"), &n)
		var b strings.Builder
		for n > 0 && len(f.queued) > 0 {
			m := f.queued[0]
			f.queued = f.queued[1:]
			n--
			sum := md5.Sum([]byte(m.body))
			fmt.Fprintf(&b, `<Message><MessageId>%s</MessageId><ReceiptHandle>rh-%s</ReceiptHandle><MD5OfBody>%s</MD5OfBody><Body>`,
				m.id, m.id, hex.EncodeToString(sum[:]))
			_ = xml.EscapeText(&b, []byte(m.body))
			fmt.Fprintf(&b, `</Body><Attribute><Name>ApproximateReceiveCount</Name><Value>%d</Value></Attribute>`, max(m.receives, 1))
			if m.group != "" {
				fmt.Fprintf(&b, `<Attribute><Name>MessageGroupId</Name><Value>%s</Value></Attribute>`, m.group)
			}
			for k, v := range m.attrs {
				fmt.Fprintf(&b, `<MessageAttribute><Name>%s</Name><Value><DataType>String</DataType><StringValue>%s</StringValue></Value></MessageAttribute>`, k, v)
			}
			b.WriteString(`</Message>`)
		}
		if b.Len() == 0 {
			f.mu.Unlock()
			time.Sleep(50 * time.Millisecond) // a short long poll
			f.mu.Lock()
		}
		fmt.Fprintf(w, `<ReceiveMessageResponse><ReceiveMessageResult>%s</ReceiveMessageResult></ReceiveMessageResponse>`, b.String())
	case "ChangeMessageVisibilityBatch":
		handles := entries(r.Form, "ChangeMessageVisibilityBatchRequestEntry", "ReceiptHandle")
		secs := entries(r.Form, "ChangeMessageVisibilityBatchRequestEntry", "VisibilityTimeout")
		ids := entries(r.Form, "ChangeMessageVisibilityBatchRequestEntry", "Id")
		f.batches[action] = len(handles)
		var b strings.Builder
		for i, h := range handles {
			f.vis = append(f.vis, h+"="+secs[i])
			fmt.Fprintf(&b, `<ChangeMessageVisibilityBatchResultEntry><Id>%s</Id></ChangeMessageVisibilityBatchResultEntry>`, ids[i])
		}
		fmt.Fprintf(w, `<ChangeMessageVisibilityBatchResponse><ChangeMessageVisibilityBatchResult>%s</ChangeMessageVisibilityBatchResult></ChangeMessageVisibilityBatchResponse>`, b.String())
	case "ChangeMessageVisibility":
		f.vis = append(f.vis, r.Form.Get("ReceiptHandle")+"="+r.Form.Get("VisibilityTimeout"))
		fmt.Fprint(w, `<ChangeMessageVisibilityResponse></ChangeMessageVisibilityResponse>`)
	case "DeleteMessageBatch":
		handles := entries(r.Form, "DeleteMessageBatchRequestEntry", "ReceiptHandle")
		ids := entries(r.Form, "DeleteMessageBatchRequestEntry", "Id")
		f.batches[action] = len(handles)
		var b strings.Builder
		for i, h := range handles {
			f.deletes = append(f.deletes, h)
			fmt.Fprintf(&b, `<DeleteMessageBatchResultEntry><Id>%s</Id></DeleteMessageBatchResultEntry>`, ids[i])
		}
		fmt.Fprintf(w, `<DeleteMessageBatchResponse><DeleteMessageBatchResult>%s</DeleteMessageBatchResult></DeleteMessageBatchResponse>`, b.String())
	case "SendMessage":
		f.sent = append(f.sent, r.Form)
		fmt.Fprintf(w, `<SendMessageResponse><SendMessageResult><MessageId>sent-%d</MessageId></SendMessageResult></SendMessageResponse>`, len(f.sent))
	default:
		w.WriteHeader(http.StatusBadRequest)
		fmt.Fprintf(w, `<ErrorResponse><Error><Type>Sender</Type><Code>InvalidAction</Code><Message>%s</Message></Error></ErrorResponse>`, action)
	}
}

// startSQSTransport prepares an SQS transport on the fake and consumes in
// the background; the deliveries come on the returned channel.
func startSQSTransport(t *testing.T, f *fakeSQS, queue string, prefetch int) (*sqsTransport, <-chan delivery) {
	t.Helper()
	return startSQSTransportWith(t, f, queue, prefetch, nil)
}

// startSQSTransportWith is startSQSTransport with configure (when not nil)
// applied to the transport before it consumes.
func startSQSTransportWith(t *testing.T, f *fakeSQS, queue string, prefetch int, configure func(*sqsTransport)) (*sqsTransport, <-chan delivery) {
	t.Helper()
	cfg := &Config{Prefetch: prefetch, SQS: &sqs.Config{Endpoint: f.srv.URL, Region: "us-east-1", Wait: time.Second,
		Credentials: aws.AnonymousCredentials{}, Queues: []sqs.Queue{{Name: queue, Task: "demo.add"}}}}
	tr := newSQSTransport(cfg, zap.NewNop())
	if configure != nil {
		configure(tr)
	}
	ctx, cancel := context.WithCancel(context.Background())
	if err := tr.prepare(ctx); err != nil {
		cancel()
		t.Fatal(err)
	}
	ch := make(chan delivery, 100)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = tr.consume(ctx, func(d delivery) { ch <- d })
	}()
	t.Cleanup(func() {
		cancel()
		<-done
		_ = tr.close()
	})
	return tr, ch
}

func next(t *testing.T, ch <-chan delivery) *sqsDelivery {
	t.Helper()
	select {
	case d := <-ch:
		return d.(*sqsDelivery)
	case <-time.After(5 * time.Second):
		t.Fatal("no delivery within 5s")
		return nil
	}
}

func none(t *testing.T, ch <-chan delivery, within time.Duration) {
	t.Helper()
	select {
	case d := <-ch:
		t.Fatalf("unexpected delivery %s", d.(*sqsDelivery).m.ID)
	case <-time.After(within):
	}
}

// TestSQSTransportFIFO (fake server that records calls): messages of a
// FIFO queue's group received together are handed on one at a time, in
// order, the next once the one before is settled; another group's go at
// once; a give-back hands back the group's waiting messages too, so that
// the group keeps its order.
func TestSQSTransportFIFO(t *testing.T) {
	f := newFakeSQS(t)
	f.add(fakeMessage{id: "a1", body: "[1, 2]", group: "a"}, fakeMessage{id: "a2", body: "[3, 4]", group: "a"},
		fakeMessage{id: "b1", body: "[5, 6]", group: "b"}, fakeMessage{id: "a3", body: "[7, 8]", group: "a"})
	_, ch := startSQSTransport(t, f, "q.fifo", 10)
	first, second := next(t, ch), next(t, ch)
	if first.m.ID != "a1" || second.m.ID != "b1" {
		t.Fatalf("first deliveries %s, %s; want a1 and b1 (a2 waits for a1)", first.m.ID, second.m.ID)
	}
	none(t, ch, 300*time.Millisecond)
	if err := first.ack(); err != nil {
		t.Fatal(err)
	}
	if d := next(t, ch); d.m.ID != "a2" {
		t.Fatalf("after a1's ack: %s, want a2", d.m.ID)
	} else if err := d.giveBack(); err != nil {
		t.Fatal(err)
	}
	none(t, ch, 300*time.Millisecond) // a3 handed back behind a2
	testkit := func() bool {
		_, vis, _ := f.recorded()
		return strings.Contains(strings.Join(vis, " "), "rh-a2=0") && strings.Contains(strings.Join(vis, " "), "rh-a3=0")
	}
	deadline := time.Now().Add(5 * time.Second)
	for !testkit() && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if _, vis, dels := f.recorded(); !testkit() || len(dels) != 1 || dels[0] != "rh-a1" {
		t.Errorf("visibility changes %v, deletes %v; want a2 and a3 handed back (0) and a1 deleted", vis, dels)
	}
}

// TestSQSTransportExtendAndDelete (fake server that records calls): held
// deliveries have their visibility extended, in one
// ChangeMessageVisibilityBatch, every third of the queue's visibility
// timeout; acks become one DeleteMessageBatch; a message's
// ApproximateReceiveCount is its delivery count.
func TestSQSTransportExtendAndDelete(t *testing.T) {
	f := newFakeSQS(t)
	f.attrs["q"] = map[string]string{"VisibilityTimeout": "3"}
	f.add(fakeMessage{id: "m1", body: "[1, 2]"}, fakeMessage{id: "m2", body: "[3, 4]", receives: 3},
		fakeMessage{id: "m3", body: "[5, 6]"})
	tr, ch := startSQSTransport(t, f, "q", 10)
	ds := []*sqsDelivery{next(t, ch), next(t, ch), next(t, ch)}
	if !ds[1].redelivered() || ds[1].deliveryCount() != 2 || ds[0].redelivered() || ds[0].deliveryCount() != 0 {
		t.Errorf("receive counts 1 and 3: redelivered %v/%v, counts %d/%d", ds[0].redelivered(), ds[1].redelivered(),
			ds[0].deliveryCount(), ds[1].deliveryCount())
	}
	time.Sleep(2500 * time.Millisecond) // past two thirds of the 3 s timeout
	_, vis, _ := f.recorded()
	for _, h := range []string{"rh-m1=3", "rh-m2=3", "rh-m3=3"} {
		if !strings.Contains(strings.Join(vis, " "), h) {
			t.Errorf("visibility changes %v: no %s", vis, h)
		}
	}
	f.mu.Lock()
	batch := f.batches["ChangeMessageVisibilityBatch"]
	f.mu.Unlock()
	if batch != 3 {
		t.Errorf("last ChangeMessageVisibilityBatch had %d entries, want 3", batch)
	}
	var wg sync.WaitGroup
	for _, d := range ds {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := d.ack(); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	calls, _, dels := f.recorded()
	n := 0
	for _, c := range calls {
		if c == "DeleteMessageBatch" {
			n++
		}
	}
	if len(dels) != 3 || n > 2 {
		t.Errorf("deletes %v in %d DeleteMessageBatch calls; want 3 in one or two", dels, n)
	}
	tr.mu.Lock()
	held := len(tr.held)
	tr.mu.Unlock()
	if held != 0 {
		t.Errorf("%d deliveries still extended after their acks", held)
	}
}

// TestSQSWirePlain: a plain message reads as a Celery message: a list body
// the positional arguments, an object the keyword ones, the task from the
// attribute or the queue, the id from task_id or the message id; one that
// cannot be read reaches the decoder as undecodable.
func TestSQSWirePlain(t *testing.T) {
	q := &sqsQueue{Queue: sqs.Queue{Name: "q", Task: "queue.task"}}
	for _, tc := range []struct {
		name, body string
		attrs      map[string]string
		queueTask  bool
		task, id   string
		args, kw   int
		retries    int
		key        string
		bad        bool
	}{
		{name: "list", body: `[1, "a", 2.5]`, attrs: map[string]string{"task": "t.x"}, task: "t.x", id: "mid", args: 3},
		{name: "object", body: `{"a": 1}`, queueTask: true, task: "queue.task", id: "mid", kw: 1},
		{name: "ids", body: `[]`, attrs: map[string]string{"task": "t.x", "task_id": "tid", "retries": "2", "idempotency_key": "k-1"},
			task: "t.x", id: "tid", retries: 2, key: "k-1"},
		{name: "no task", body: `[1]`, bad: true},
		{name: "not json", body: `[1`, attrs: map[string]string{"task": "t.x"}, bad: true},
		{name: "scalar", body: `7`, attrs: map[string]string{"task": "t.x"}, bad: true},
		{name: "bad retries", body: `[]`, attrs: map[string]string{"task": "t.x", "retries": "x"}, bad: true},
	} {
		qq := q
		if !tc.queueTask {
			qq = &sqsQueue{Queue: sqs.Queue{Name: "q"}}
		}
		w, kombu := sqsWire(qq, sqs.Message{ID: "mid", Body: tc.body, Attributes: tc.attrs, ReceiveCount: 2})
		if kombu || !w.Redelivered {
			t.Errorf("%s: kombu %v, redelivered %v", tc.name, kombu, w.Redelivered)
		}
		m, err := celeryproto.Decode(w)
		if tc.bad {
			if err == nil {
				t.Errorf("%s: decoded %+v, want undecodable", tc.name, m)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		key, _ := m.Headers["idempotency_key"].(string)
		if m.Task != tc.task || m.ID != tc.id || len(m.Args) != tc.args || len(m.Kwargs) != tc.kw || m.Retries != tc.retries || key != tc.key {
			t.Errorf("%s: decoded %+v", tc.name, m)
		}
	}
}
