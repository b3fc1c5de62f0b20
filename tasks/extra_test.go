package tasks

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/pause"
	"github.com/onceler/onceler/internal/testkit"
)

// TestPoisonQuorum: a message redelivered more than MaxAttempts times on a
// quorum queue (x-delivery-count) is quarantined as poison, not run.
func TestPoisonQuorum(t *testing.T) {
	e := newEnv(t)
	q := e.queue + "_qq"
	if _, err := e.ch.QueueDeclare(q, true, false, false, false, amqp091.Table{"x-queue-type": "quorum"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = e.ch.QueueDelete(q, false, false, false)
		_, _ = e.ch.QueueDelete(quarantineName(q), false, false, false)
	})
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

func encodeForTest(m *celeryprotoMessage) (amqp091.Publishing, error) {
	p, err := encodeTask(m)
	if err != nil {
		return amqp091.Publishing{}, err
	}
	return amqp091.Publishing{ContentType: p.ContentType, ContentEncoding: p.ContentEncoding,
		Headers: amqp091.Table(p.Headers), Body: p.Body, CorrelationId: p.CorrelationID, DeliveryMode: 2}, nil
}

type retryArgs struct{ N int64 }

// TestRetryWithPython: a task that asks for a Celery retry runs again with
// the same id and retries+1; the Python caller gets the final result.
func TestRetryWithPython(t *testing.T) {
	e := newEnv(t)
	var runs atomic.Int32
	reg := NewRegistry()
	err := Register(reg, Task[retryArgs]{Name: "t.flaky", Retry: RetryPolicy{MaxRetries: 3},
		Run: func(_ context.Context, c *Call, a retryArgs) (any, error) {
			runs.Add(1)
			if int64(c.Retries) < a.N {
				return nil, c.Retry(100*time.Millisecond, errors.New("not yet"))
			}
			return map[string]any{"retries": c.Retries}, nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	// The same in outside mode: the retry releases the claim, the retried
	// message claims it again (not a duplicate) and completes it once.
	fx := &effects{}
	err = Register(reg, Task[retryArgs]{Name: "t.flaky_outside", Mode: ModeOutside, Retry: RetryPolicy{MaxRetries: 3},
		Key: func(a retryArgs) (string, error) { return fmt.Sprint("op-", a.N), nil },
		Run: func(_ context.Context, c *Call, a retryArgs) (any, error) {
			if int64(c.Retries) < a.N {
				return nil, c.Retry(100*time.Millisecond, errors.New("not yet"))
			}
			fx.add(c.Key)
			return map[string]any{"retries": c.Retries, "attempt": c.Attempt}, nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	e.start(reg, e.config())
	res := e.python(2, "json",
		pyCall{Task: "t.flaky", Args: []any{2}},
		pyCall{Task: "t.flaky", Args: []any{9}},
		pyCall{Task: "t.flaky_outside", Args: []any{2}},
		// ignore_result keeps only SUCCESS from the caller, as Celery's
		// worker does: the retries and the final failure still come.
		pyCall{Task: "t.flaky", Args: []any{9}, IgnoreResult: true},
	)
	if res[3].ExcType != "Exception" || res[3].Message != "not yet" {
		t.Errorf("past max retries, ignore_result: %+v", res[3])
	}
	if string(res[2].OK) != `{"attempt": 3, "retries": 2}` {
		t.Errorf("outside-mode retried task: %+v", res[2])
	}
	if n := fx.snapshot()["op-2"]; n != 1 {
		t.Errorf("outside-mode retried operation: %d effects", n)
	}
	rec, err := e.store.Get(context.Background(), "t.flaky_outside", "op-2")
	if err != nil || rec.Status != idempotency.StatusCompleted {
		t.Errorf("record %+v, %v", rec, err)
	}
	if string(res[0].OK) != `{"retries": 2}` {
		t.Errorf("retried task: %+v", res[0])
	}
	if res[1].ExcType != "Exception" || res[1].Message != "not yet" {
		t.Errorf("past max retries: %+v", res[1])
	}
	if n := runs.Load(); n != 3+4+4 {
		t.Errorf("%d runs, want 11", n)
	}
}

// TestResultSerializer: with Config.ResultSerializer msgpack or yaml, a
// Celery app that accepts nothing else reads the results, values and
// failures alike.
func TestResultSerializer(t *testing.T) {
	for _, ser := range []string{"msgpack", "yaml"} {
		t.Run(ser, func(t *testing.T) {
			e := newEnv(t)
			cfg := e.config()
			cfg.ResultSerializer = ser
			e.start(testRegistry(t, &effects{}), cfg)
			res := e.pythonSpec(map[string]any{"protocol": 2, "serializer": ser, "accept": []string{ser}, "result_accept": []string{ser}},
				pyCall{Task: "t.add", Args: []any{2, 3}},
				pyCall{Task: "t.fail_value", Args: []any{1, 2}},
				pyCall{Task: "t.nope"},
			)
			if string(res[0].OK) != "5" {
				t.Errorf("value: %+v", res[0])
			}
			if res[1].ExcType != "ValueError" || res[1].Message != "x must be positive" {
				t.Errorf("failure: %+v", res[1])
			}
			if res[2].ExcType != "NotRegistered" || res[2].Message != "t.nope" {
				t.Errorf("unknown task: %+v", res[2])
			}
		})
	}
	if _, err := NewWorker(NewRegistry(), Config{ResultSerializer: "pickle"}); err == nil || !strings.Contains(err.Error(), "pickle") {
		t.Errorf("NewWorker with result serializer pickle: %v", err)
	}
}

// TestHealthHandler: /readyz answers 200 only while the worker consumes.
func TestHealthHandler(t *testing.T) {
	e := newEnv(t)
	cfg := e.config()
	cfg.Pool = testenvPool(t)
	w, err := NewWorker(testRegistry(t, &effects{}), cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(w.HealthHandler())
	defer srv.Close()
	status := func(path string) int {
		resp, err := http.Get(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		return resp.StatusCode
	}
	if s := status("/readyz"); s != http.StatusServiceUnavailable {
		t.Errorf("readyz before Run: %d", s)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	testkit.WaitFor(t, "ready", 10*time.Second, func() bool { return status("/readyz") == http.StatusOK })
	if s := status("/healthz"); s != http.StatusOK {
		t.Errorf("healthz while running: %d", s)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if s := status("/readyz"); s != http.StatusServiceUnavailable {
		t.Errorf("readyz after Run: %d", s)
	}
	srv.CloseClientConnections()
}

type waitArgs struct{ Ms int64 }

// TestTimeLimitsAndCountdownFromPython: the soft limit cancels the task's
// context and the caller sees SoftTimeLimitExceeded; the hard limit from the
// message gives TimeLimitExceeded; a countdown delays the run.
func TestTimeLimitsAndCountdownFromPython(t *testing.T) {
	e := newEnv(t)
	reg := NewRegistry()
	err := Register(reg, Task[waitArgs]{Name: "t.wait",
		Run: func(ctx context.Context, _ *Call, a waitArgs) (any, error) {
			if !pause.For(ctx, time.Duration(a.Ms)*time.Millisecond) {
				return nil, context.Cause(ctx)
			}
			return time.Now().UnixMilli(), nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	e.start(reg, e.config())
	start := time.Now().UnixMilli()
	res := e.python(2, "json",
		pyCall{Task: "t.wait", Args: []any{5000}, Options: map[string]any{"soft_time_limit": 0.2}},
		pyCall{Task: "t.wait", Args: []any{5000}, Options: map[string]any{"time_limit": 0.3}},
		pyCall{Task: "t.wait", Args: []any{0}, Options: map[string]any{"countdown": 1.5}},
	)
	if res[0].ExcType != "SoftTimeLimitExceeded" {
		t.Errorf("soft limit: %+v", res[0])
	}
	if res[1].ExcType != "TimeLimitExceeded" {
		t.Errorf("hard limit: %+v", res[1])
	}
	var ranAt int64
	if err := json.Unmarshal(res[2].OK, &ranAt); err != nil || ranAt-start < 1400 {
		t.Errorf("countdown task ran %d ms after sending (%+v)", ranAt-start, res[2])
	}
}
