package tasks

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// TestHeldAndSkippedAnswerPython: a Python caller whose operation is found
// held (or skipped) gets a FAILURE at once and raises the exception class
// named OperationHeld (OperationSkipped), which Celery makes for the
// unimportable module onceler.exceptions; the deliveries are acknowledged.
func TestHeldAndSkippedAnswerPython(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	reg := NewRegistry()
	var runs atomic.Int32
	for _, tk := range []Task[payArgs]{{Name: "p.hold", Policy: PolicyHold}, {Name: "p.skip", Policy: PolicySkip}} {
		tk.Mode = ModeOutside
		tk.Key = func(a payArgs) (string, error) { return a.OrderID, nil }
		tk.Run = func(context.Context, *Call, payArgs) (any, error) { runs.Add(1); return nil, nil }
		if err := Register(reg, tk); err != nil {
			t.Fatal(err)
		}
	}
	e.start(reg, e.config())
	kw := func(order string) map[string]any { return map[string]any{"order_id": order, "amount": int64(100)} }
	e.staleClaim("p.hold", "h-py", kw("h-py"))
	e.staleClaim("p.skip", "s-py", kw("s-py"))
	start := time.Now()
	res := e.python(2, "json",
		pyCall{Task: "p.hold", Kwargs: kw("h-py")},
		pyCall{Task: "p.hold", Kwargs: kw("h-py")}, // found held by a later delivery
		pyCall{Task: "p.skip", Kwargs: kw("s-py")},
	)
	took := time.Since(start)
	t.Logf("three callers answered in %s", took)
	for i, want := range []string{"OperationHeld", "OperationHeld", "OperationSkipped"} {
		if res[i].ExcType != want || !strings.Contains(res[i].Message, "stale claim") {
			t.Errorf("call %d: %+v, want %s", i, res[i], want)
		}
	}
	if took > 15*time.Second {
		t.Errorf("callers answered after %s: not promptly (client timeout 30 s)", took)
	}
	if runs.Load() != 0 {
		t.Errorf("task ran %d times", runs.Load())
	}
	testkit.WaitFor(t, "queue empty", 10*time.Second, func() bool { return e.queueDepth(e.queue) == 0 })
}

// TestResultSerializer: with Config.ResultSerializer msgpack or yaml, a
// Celery app that accepts nothing else reads the results, values and
// failures alike.
func TestResultSerializer(t *testing.T) {
	t.Parallel()
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

// TestFullReplyQueueDoesNotRerunTask: a producer names as reply_to a
// queue that refuses every publish (x-max-length 0, overflow
// reject-publish: the broker nacks). As Celery's worker, the worker sends
// the result (lost) and acknowledges: the task runs once, not again and
// again.
func TestFullReplyQueueDoesNotRerunTask(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int32
	r := NewRegistry()
	if err := Register(r, Task[blockArgs]{Name: "t.count", Run: func(context.Context, *Call, blockArgs) (any, error) {
		runs.Add(1)
		return "ok", nil
	}}); err != nil {
		t.Fatal(err)
	}
	cfg := e.config()
	e.start(r, cfg)
	full := testenv.Name("full")
	if _, err := e.ch.QueueDeclare(full, false, true, false, false, amqp091.Table{
		"x-max-length": int32(0), "x-overflow": "reject-publish"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = e.ch.QueueDelete(full, false, false, false) })
	e.publish(&celeryproto.Message{Task: "t.count", ID: taskID(1), Kwargs: map[string]any{"pad": "x"}, ReplyTo: full})
	time.Sleep(25 * time.Second)
	if n := runs.Load(); n != 1 {
		t.Fatalf("task ran %d times in 25 s, want once (its reply queue refuses every publish)", n)
	}
	if _, err := e.ch.QueuePurge(e.queue, false); err != nil {
		t.Fatal(err)
	}
}
