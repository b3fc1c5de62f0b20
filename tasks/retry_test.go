package tasks

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceler/onceler/idempotency"
)

type retryArgs struct{ N int64 }

// TestRetryWithPython: a task that asks for a Celery retry runs again with
// the same id and retries+1; the Python caller gets the final result.
func TestRetryWithPython(t *testing.T) {
	t.Parallel()
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

// TestRetriesWithPython: Celery-style retries seen from a real Celery
// caller: the retries count reaches the task and the result comes back;
// past max retries the caller gets MaxRetriesExceededError (no cause) or the
// cause; automatic retries with backoff; an outside-mode operation past its
// retries is recorded failed.
func TestRetriesWithPython(t *testing.T) {
	e := newEnv(t)
	reg := NewRegistry()
	for _, err := range []error{
		Register(reg, Task[flakyArgs]{Name: "t.flaky", Retry: RetryPolicy{MaxRetries: 3},
			Run: func(_ context.Context, c *Call, a flakyArgs) (any, error) {
				if int64(c.Retries) < a.Failures {
					return nil, c.Retry(50*time.Millisecond, ValueError("not yet"))
				}
				return map[string]any{"retries": c.Retries}, nil
			}}),
		Register(reg, Task[flakyArgs]{Name: "t.nocause", Retry: RetryPolicy{MaxRetries: 2, Countdown: 50 * time.Millisecond},
			Run: func(_ context.Context, c *Call, _ flakyArgs) (any, error) {
				return nil, c.Retry(0, nil)
			}}),
		Register(reg, Task[flakyArgs]{Name: "t.auto",
			Retry: RetryPolicy{MaxRetries: 3, Backoff: 100 * time.Millisecond, NoJitter: true,
				AutoRetry: func(err error) bool { return errors.Is(err, errTemporary) }},
			Run: func(_ context.Context, c *Call, a flakyArgs) (any, error) {
				if int64(c.Retries) < a.Failures {
					return nil, fmt.Errorf("attempt %d: %w", c.Retries, errTemporary)
				}
				if a.Failures < 0 {
					return nil, errors.New("permanent trouble")
				}
				return c.Retries, nil
			}}),
		Register(reg, Task[flakyArgs]{Name: "t.outside_retry", Mode: ModeOutside, Retry: RetryPolicy{MaxRetries: 1},
			Key: func(a flakyArgs) (string, error) { return a.Op, nil },
			Run: func(_ context.Context, c *Call, _ flakyArgs) (any, error) {
				return nil, c.Retry(50*time.Millisecond, KeyError("still missing"))
			}}),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	e.start(reg, e.config())
	res := e.calls(
		wfCall{Name: "flaky", Task: "t.flaky", Args: []any{2}},
		wfCall{Name: "nocause", Task: "t.nocause", Args: []any{0}},
		wfCall{Name: "auto", Task: "t.auto", Args: []any{2}},
		wfCall{Name: "auto_exhausted", Task: "t.auto", Args: []any{9}},
		wfCall{Name: "auto_other", Task: "t.auto", Args: []any{-1}},
		wfCall{Name: "outside", Task: "t.outside_retry", Args: []any{0, "op-r"}},
	)
	if r := res["flaky"]; string(r.Result) != `{"retries": 2}` {
		t.Errorf("flaky: %+v", r)
	}
	if r := res["nocause"]; r.ExcType != "MaxRetriesExceededError" || r.ExcModule != "celery.exceptions" ||
		!strings.HasPrefix(r.Message, "Can't retry t.nocause["+r.ID+"]") {
		t.Errorf("past max retries without a cause: %+v", r)
	}
	// Backoff 100 ms × 2^n without jitter: 100 + 200 ms before the third run.
	if r := res["auto"]; string(r.Result) != `2` || r.Elapsed < 0.3 {
		t.Errorf("automatic retries: %+v", r)
	}
	if r := res["auto_exhausted"]; r.ExcType != "Exception" || !strings.Contains(r.Message, "attempt 3: temporary trouble") {
		t.Errorf("automatic retries used up: %+v", r)
	}
	if r := res["auto_other"]; r.ExcType != "Exception" || r.Message != "permanent trouble" || r.Elapsed > 2 {
		t.Errorf("error not retried automatically: %+v", r)
	}
	if r := res["outside"]; r.ExcType != "KeyError" {
		t.Errorf("outside past max retries: %+v", r)
	}
	rec, err := e.store.Get(context.Background(), "t.outside_retry", "op-r")
	if err != nil || rec.Status != idempotency.StatusFailed || rec.Attempt != 2 {
		t.Errorf("outside record after max retries: %+v, %v (want failed, attempt 2)", rec, err)
	}
}

func TestRetryDelay(t *testing.T) {
	t.Parallel()
	fixed := func(n int64) int64 { return n - 1 } // the top of the jitter range
	cases := []struct {
		p       RetryPolicy
		retries int
		want    time.Duration
	}{
		{RetryPolicy{}, 0, 180 * time.Second},
		{RetryPolicy{Countdown: time.Second}, 5, time.Second},
		{RetryPolicy{Backoff: time.Second, NoJitter: true}, 0, time.Second},
		{RetryPolicy{Backoff: time.Second, NoJitter: true}, 3, 8 * time.Second},
		{RetryPolicy{Backoff: time.Second, NoJitter: true}, 20, 10 * time.Minute},
		{RetryPolicy{Backoff: time.Second, BackoffMax: 5 * time.Second, NoJitter: true}, 3, 5 * time.Second},
		{RetryPolicy{Backoff: time.Second, NoJitter: true}, 200, 10 * time.Minute},
		{RetryPolicy{Backoff: time.Second}, 2, 4 * time.Second},
	}
	for _, c := range cases {
		if got := c.p.delay(c.retries, fixed); got != c.want {
			t.Errorf("%+v retries %d: delay %s, want %s", c.p, c.retries, got, c.want)
		}
	}
	p := RetryPolicy{Backoff: time.Second}
	for range 100 {
		if d := p.delay(3, rand.Int64N); d < 0 || d > 8*time.Second {
			t.Fatalf("jittered delay %s outside [0, 8s]", d)
		}
	}
}
