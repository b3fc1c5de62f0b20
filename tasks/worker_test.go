package tasks

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

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
	t.Parallel()
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

type amqp091Delivery struct{ reason, detail, queue, body, contentType string }

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
	t.Parallel()
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
		deferred += counterValue(w.w.m.deferred.WithLabelValues("t.pay_slow"))
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
	ran := counterValue(w1.w.m.succeeded.WithLabelValues("t.pay_slow")) + counterValue(w2.w.m.succeeded.WithLabelValues("t.pay_slow"))
	suppressed := counterValue(w1.w.m.duplicates.WithLabelValues("t.pay_slow")) + counterValue(w2.w.m.duplicates.WithLabelValues("t.pay_slow"))
	if ran != keys || suppressed != keys*(repeats-1) {
		t.Errorf("counters: %v succeeded, %v duplicates suppressed; want %d and %d", ran, suppressed, keys, keys*(repeats-1))
	}
}
