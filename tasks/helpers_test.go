package tasks

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"
	"go.uber.org/zap/zaptest"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/pause"
	"github.com/onceler/onceler/internal/testenv"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// env is one test's broker names, schema and record.
type env struct {
	t      *testing.T
	url    string
	queue  string
	store  *idempotency.Store
	schema string
	conn   *amqp091.Connection
	ch     *amqp091.Channel
	// backend is the result backend of the Python side (wf.py); "" is
	// rpc://.
	backend string
}

func newEnv(t *testing.T) *env {
	t.Helper()
	e := &env{t: t, url: testenv.AMQPURL(t), queue: testenv.Name("tq")}
	pool := testenv.Pool(t)
	e.schema = testenv.Schema(t, pool)
	s, err := idempotency.New(pool, idempotency.Config{Schema: e.schema})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	e.store = s
	conn, err := amqp091.Dial(e.url)
	if err != nil {
		t.Fatal(err)
	}
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	e.conn, e.ch = conn, ch
	// Declare as kombu does, so the Python producer and the worker agree.
	if err := ch.ExchangeDeclare(e.queue, "direct", true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(e.queue, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := ch.QueueBind(e.queue, e.queue, e.queue, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = ch.QueueDelete(e.queue, false, false, false)
		_, _ = ch.QueueDelete(quarantineName(e.queue), false, false, false)
		_ = ch.ExchangeDelete(e.queue, false, false)
		_ = conn.Close()
	})
	return e
}

// storeOn opens a store of the env's record schema on pool, with batch;
// it closes when the test ends.
func (e *env) storeOn(pool *pgxpool.Pool, batch idempotency.BatchConfig) *idempotency.Store {
	e.t.Helper()
	s, err := idempotency.New(pool, idempotency.Config{Schema: e.schema, Batch: batch})
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(s.Close)
	return s
}

func (e *env) config() Config {
	return Config{
		Broker: amqp.Config{URL: e.url, Name: testenv.Name("worker"), MinBackoff: 50 * time.Millisecond, MaxBackoff: time.Second,
			Logger: zaptest.NewLogger(e.t)},
		Queues:   []amqp.QueueSpec{amqp.CeleryQueue(e.queue)},
		Store:    e.store,
		Lease:    5 * time.Second,
		Grace:    10 * time.Second,
		Hostname: testenv.Name("node"),
		Logger:   zaptest.NewLogger(e.t),
		// The tests of the worker's own remote control turn it on.
		NoControl: true,
	}
}

// run runs w, made by the test, until the test ends; its error fails
// the test.
func (e *env) run(w *Worker) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	e.t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			e.t.Error(err)
		}
	})
}

// running is a worker started by a test.
type running struct {
	w      *Worker
	cancel context.CancelFunc
	done   chan error
	once   sync.Once
	err    error
}

func (e *env) start(reg *Registry, cfg Config) *running {
	e.t.Helper()
	w, err := NewWorker(reg, cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{w: w, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- w.Run(ctx) }()
	deadline := time.Now().Add(20 * time.Second)
	for !w.Ready() {
		if time.Now().After(deadline) {
			r.stop(e.t)
			e.t.Fatal("worker not ready after 20s")
		}
		time.Sleep(20 * time.Millisecond)
	}
	e.t.Cleanup(func() { r.stop(e.t) })
	return r
}

func (r *running) stop(t *testing.T) {
	r.once.Do(func() {
		r.cancel()
		select {
		case r.err = <-r.done:
		case <-time.After(60 * time.Second):
			t.Error("worker did not stop within 60s")
		}
	})
	if r.err != nil {
		t.Errorf("worker Run: %v", r.err)
	}
}

// pyResult is one line of testdata/client.py output.
type pyResult struct {
	ID        string          `json:"id"`
	OK        json.RawMessage `json:"ok"`
	ExcType   string          `json:"exc_type"`
	ExcModule string          `json:"exc_module"`
	Message   string          `json:"message"`
	Traceback string          `json:"traceback"`
}

type pyCall struct {
	Task    string         `json:"task,omitempty"`
	Args    []any          `json:"args,omitempty"`
	Kwargs  map[string]any `json:"kwargs,omitempty"`
	Headers map[string]any `json:"headers,omitempty"`
	Options map[string]any `json:"options,omitempty"`
	// IgnoreResult sends the call with ignore_result and waits for what the
	// worker still reports (a failure or a retry; a success never comes).
	IgnoreResult bool `json:"ignore_result,omitempty"`
	// AfterPrevious sends the call only after the results of the calls
	// before it have arrived.
	AfterPrevious bool `json:"after_previous,omitempty"`
	// Group sends these calls as one Celery group (Task is then empty) and
	// reports GroupResult.get().
	Group []pyCall `json:"group,omitempty"`
}

// python sends calls with real Celery and returns what AsyncResult.get gave.
func (e *env) python(protocol int, serializer string, calls ...pyCall) []pyResult {
	e.t.Helper()
	return e.pythonSpec(map[string]any{"protocol": protocol, "serializer": serializer}, calls...)
}

// pythonSpec is python with more of client.py's spec: "accept" and
// "result_accept" (the client app's accept_content, result_accept_content).
func (e *env) pythonSpec(opts map[string]any, calls ...pyCall) []pyResult {
	e.t.Helper()
	py := testenv.Python(e.t)
	opts["broker"], opts["queue"], opts["timeout"], opts["calls"] = e.url, e.queue, 30, calls
	spec, _ := json.Marshal(opts)
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, py, filepath.Join("testdata", "client.py"), string(spec))
	out, err := cmd.Output()
	if err != nil {
		var stderr string
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = string(ee.Stderr)
		}
		e.t.Fatalf("client.py: %v\n%s", err, stderr)
	}
	var res struct{ Results []pyResult }
	if err := json.Unmarshal(out, &res); err != nil {
		e.t.Fatalf("client.py output %q: %v", out, err)
	}
	if len(res.Results) != len(calls) {
		e.t.Fatalf("client.py returned %d results for %d calls", len(res.Results), len(calls))
	}
	return res.Results
}

// publish sends a Celery protocol 2 message built in Go.
func (e *env) publish(m *celeryproto.Message) {
	e.t.Helper()
	p, err := celeryproto.EncodeTask(m, celeryproto.EncodeOptions{})
	if err != nil {
		e.t.Fatal(err)
	}
	e.publishRaw(p)
}

func (e *env) publishRaw(p *celeryproto.Publishing) {
	e.t.Helper()
	err := e.ch.PublishWithContext(context.Background(), "", e.queue, false, false, amqp091.Publishing{
		ContentType: p.ContentType, ContentEncoding: p.ContentEncoding, Headers: amqp091.Table(p.Headers),
		Body: p.Body, CorrelationId: p.CorrelationID, ReplyTo: p.ReplyTo, DeliveryMode: 2,
	})
	if err != nil {
		e.t.Fatal(err)
	}
}

// replyQueue declares an exclusive reply queue and returns its name and a
// channel of results by task id.
func (e *env) replyQueue() (string, <-chan map[string]any) {
	e.t.Helper()
	ch, err := e.conn.Channel()
	if err != nil {
		e.t.Fatal(err)
	}
	q, err := ch.QueueDeclare(testenv.Name("reply"), false, true, true, false, nil)
	if err != nil {
		e.t.Fatal(err)
	}
	msgs, err := ch.Consume(q.Name, "", true, true, false, false, nil)
	if err != nil {
		e.t.Fatal(err)
	}
	out := make(chan map[string]any, 10000)
	go func() {
		defer close(out)
		for m := range msgs {
			var r map[string]any
			if err := json.Unmarshal(m.Body, &r); err != nil {
				r = map[string]any{"undecodable": string(m.Body)}
			}
			if r["task_id"] != m.CorrelationId {
				r["correlation_mismatch"] = m.CorrelationId
			}
			out <- r
		}
	}()
	e.t.Cleanup(func() { _ = ch.Close() })
	return q.Name, out
}

// queueDepth returns the number of ready messages in a queue.
func (e *env) queueDepth(name string) int {
	e.t.Helper()
	q, err := e.ch.QueueDeclarePassive(name, true, false, false, false, nil)
	if err != nil {
		e.t.Fatalf("inspect queue %s: %v", name, err)
	}
	return q.Messages
}

// quarantined fetches every message from the quarantine queue.
func (e *env) quarantined() []amqp091.Delivery {
	e.t.Helper()
	var out []amqp091.Delivery
	for {
		d, ok, err := e.ch.Get(quarantineName(e.queue), true)
		if err != nil {
			e.t.Fatal(err)
		}
		if !ok {
			return out
		}
		out = append(out, d)
	}
}

func taskID(i int) string { return fmt.Sprintf("00000000-0000-4000-8000-%012d", i) }

func jsonString(v any) (string, error) {
	b, err := json.Marshal(v)
	return string(b), err
}

func testenvPool(t *testing.T) *pgxpool.Pool { return testenv.Pool(t) }

type celeryprotoMessage = celeryproto.Message

func encodeTask(m *celeryproto.Message) (*celeryproto.Publishing, error) {
	return celeryproto.EncodeTask(m, celeryproto.EncodeOptions{})
}

// collect gathers the replies that arrive within timeout, by task id,
// without failing the test.
func collect(replies <-chan map[string]any, n int, timeout time.Duration) map[string][]map[string]any {
	out := make(map[string][]map[string]any)
	deadline := time.After(timeout)
	for got := 0; got < n; got++ {
		select {
		case r := <-replies:
			id, _ := r["task_id"].(string)
			out[id] = append(out[id], r)
		case <-deadline:
			return out
		}
	}
	return out
}

func encodeForTest(m *celeryprotoMessage) (amqp091.Publishing, error) {
	p, err := encodeTask(m)
	if err != nil {
		return amqp091.Publishing{}, err
	}
	return amqp091.Publishing{ContentType: p.ContentType, ContentEncoding: p.ContentEncoding,
		Headers: amqp091.Table(p.Headers), Body: p.Body, CorrelationId: p.CorrelationID, DeliveryMode: 2}, nil
}

type opArgs struct {
	Op string `json:"op"`
}

func opKey(a opArgs) (string, error) { return a.Op, nil }

type sleepArgs struct {
	ID string `celery:"order_id"`
	Ms int64  `celery:"amount"`
}

// sleepRegistry has "t.sleep": an outside-mode task that sleeps Ms
// milliseconds (giving up when its context ends) and then counts its effect.
func sleepRegistry(t *testing.T, fx *effects) *Registry {
	t.Helper()
	reg := NewRegistry()
	err := Register(reg, Task[sleepArgs]{
		Name: "t.sleep", Mode: ModeOutside, Policy: PolicyRetry,
		Key: func(a sleepArgs) (string, error) { return a.ID, nil },
		Run: func(ctx context.Context, c *Call, a sleepArgs) (any, error) {
			if !pause.For(ctx, time.Duration(a.Ms)*time.Millisecond) {
				return nil, fmt.Errorf("interrupted: %w", context.Cause(ctx))
			}
			fx.add(c.Key)
			return a.ID, nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	return reg
}

func sleepMessage(i int, ms int64, replyTo string) *celeryproto.Message {
	m := payMessage("t.sleep", i, fmt.Sprintf("s-%d", i), replyTo)
	m.Kwargs["amount"] = ms
	return m
}

// wfCall is a wf.py call spec.
type wfCall struct {
	Name    string         `json:"name"`
	Task    string         `json:"task"`
	Args    []any          `json:"args,omitempty"`
	Kwargs  map[string]any `json:"kwargs,omitempty"`
	Options map[string]any `json:"options,omitempty"`
	ReadyAt float64        `json:"ready_at,omitempty"`
}

// wfOutcome is what wf.py reports for a call spec.
type wfOutcome struct {
	ID         string          `json:"id"`
	Result     json.RawMessage `json:"result"`
	ExcType    string          `json:"exc_type"`
	ExcModule  string          `json:"exc_module"`
	Message    string          `json:"message"`
	Elapsed    float64         `json:"elapsed"`
	ReadyEarly *bool           `json:"ready_early"`
}

// calls sends call specs with real Celery (testdata/wf.py) and returns
// their outcomes by name.
func (e *env) calls(calls ...wfCall) map[string]wfOutcome {
	e.t.Helper()
	args := make([]string, len(calls))
	for i, c := range calls {
		b, err := json.Marshal(c)
		if err != nil {
			e.t.Fatal(err)
		}
		args[i] = string(b)
	}
	res := e.workflows(testenv.Name("unused"), args...)
	out := make(map[string]wfOutcome, len(res))
	for name, r := range res {
		var o wfOutcome
		if err := json.Unmarshal(r.OK, &o); err != nil {
			e.t.Fatalf("%s: %s: %v", name, r.OK, err)
		}
		out[name] = o
	}
	return out
}

type flakyArgs struct {
	Failures int64  `celery:"failures"`
	Op       string `celery:"op,optional"`
}

var errTemporary = errors.New("temporary trouble")

// counterValue reads a Prometheus counter.
func counterValue(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		return -1
	}
	return m.GetCounter().GetValue()
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

// quorumQueue declares a quorum queue beside the env's queue, deleted (with
// its quarantine) when the test ends, and returns its name.
func (e *env) quorumQueue() string {
	e.t.Helper()
	q := e.queue + "_qq"
	if _, err := e.ch.QueueDeclare(q, true, false, false, false, amqp091.Table{"x-queue-type": "quorum"}); err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() {
		_, _ = e.ch.QueueDelete(q, false, false, false)
		_, _ = e.ch.QueueDelete(quarantineName(q), false, false, false)
	})
	return q
}

// consumerOf is the consumer of w's AMQP transport.
func consumerOf(w *Worker) *amqp.Consumer { return w.tr.(*amqpTransport).consumer }
