package tasks

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/pause"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

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

// TestCountdownAndExpiresWithPython: 40 countdown tasks held at once do not
// block 10 immediate ones sent behind them (prefetch 4); countdown=3 is not
// ready before 3 s and is right after; an expires that passes while the task waits for its
// countdown makes AsyncResult.get() raise TaskRevokedError when it passes.
func TestCountdownAndExpiresWithPython(t *testing.T) {
	e := newEnv(t)
	rec := &callRecorder{}
	cfg := e.config()
	cfg.Concurrency, cfg.Prefetch = 2, 4
	e.start(workflowRegistry(t, rec), cfg)
	flood := e.workflows(testenv.Name("unused"), "eta_flood")["eta_flood"]
	var f struct {
		Quick        []int64 `json:"quick"`
		QuickSeconds float64 `json:"quick_seconds"`
		Held         []int64 `json:"held"`
		HeldSeconds  float64 `json:"held_seconds"`
	}
	if err := json.Unmarshal(flood.OK, &f); err != nil {
		t.Fatalf("eta_flood: %+v: %v", flood, err)
	}
	t.Logf("10 immediate tasks behind 40 held countdown tasks (prefetch 4): answered in %.3f s; all countdown results read after %.3f s",
		f.QuickSeconds, f.HeldSeconds)
	if len(f.Quick) != 10 || len(f.Held) != 40 || f.Quick[9] != 10 || f.Held[39] != 39 {
		t.Errorf("eta_flood results %+v", f)
	}
	if f.QuickSeconds > 2 || f.HeldSeconds < 5 {
		t.Errorf("immediate tasks took %.3f s behind held ones (want < 2 s); countdown tasks took %.3f s (want >= 5 s)",
			f.QuickSeconds, f.HeldSeconds)
	}
	res := e.calls(
		wfCall{Name: "countdown", Task: "t.add", Args: []any{2, 3}, Options: map[string]any{"countdown": 3}, ReadyAt: 2.5},
		wfCall{Name: "expires", Task: "t.add", Args: []any{2, 3}, Options: map[string]any{"countdown": 4, "expires": 1}},
	)
	if r := res["countdown"]; string(r.Result) != "5" || r.ReadyEarly == nil || *r.ReadyEarly || r.Elapsed < 3 || r.Elapsed > 4.5 {
		t.Errorf("countdown=3: %+v", r)
	}
	// Answered when it expires, not when it would have been due.
	if r := res["expires"]; r.ExcType != "TaskRevokedError" || r.Message != "expired" || r.Elapsed < 1 || r.Elapsed > 3 {
		t.Errorf("expired before it ran: %+v", r)
	}
}

// TestETADoesNotStarve: many deliveries held for their ETA do not block
// immediate ones behind them, on a classic queue (global QoS grows with the
// held set) and on a quorum queue (per-consumer QoS, consumers restarted
// under the grown limit).
func TestETADoesNotStarve(t *testing.T) {
	for _, quorum := range []bool{false, true} {
		t.Run(fmt.Sprintf("quorum=%v", quorum), func(t *testing.T) {
			e := newEnv(t)
			cfg := e.config()
			cfg.Concurrency, cfg.Prefetch = 2, 4
			if quorum {
				q := e.queue + "_qq"
				if _, err := e.ch.QueueDeclare(q, true, false, false, false, amqp091.Table{"x-queue-type": "quorum"}); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() {
					_, _ = e.ch.QueueDelete(q, false, false, false)
					_, _ = e.ch.QueueDelete(quarantineName(q), false, false, false)
				})
				e.queue = q
				cfg.Queues = []amqp.QueueSpec{{Name: q, Exchange: amqp.DefaultExchange, Durable: true, Quorum: true}}
			}
			fx := &effects{}
			r := e.start(testRegistry(t, fx), cfg)
			replyTo, replies := e.replyQueue()
			const held, quick = 40, 10
			due := time.Now().Add(5 * time.Second)
			for i := range held {
				m := payMessage("t.pay", i, fmt.Sprintf("eta-%d", i), replyTo)
				m.ETA = due
				e.publish(m)
			}
			testkit.WaitFor(t, "ETA deliveries held", 10*time.Second, func() bool { return len(r.w.Scheduled()) == held })
			testkit.WaitFor(t, "prefetch grown by the held set", 5*time.Second, func() bool { return r.w.consumer.Prefetch() == cfg.Prefetch+held })
			sent := time.Now()
			for i := range quick {
				e.publish(payMessage("t.pay", held+i, fmt.Sprintf("now-%d", i), replyTo))
			}
			got := results(t, replies, quick, 10*time.Second)
			took := time.Since(sent)
			for i := range quick {
				if len(got[taskID(held+i)]) != 1 {
					t.Fatalf("immediate tasks answered: %v", got)
				}
			}
			if !time.Now().Before(due) {
				t.Errorf("immediate tasks answered only after the ETAs were due (%s)", took)
			}
			t.Logf("%d immediate tasks answered in %s behind %d held ETA deliveries (prefetch %d)", quick, took, held, r.w.consumer.Prefetch())
			got = results(t, replies, held, 20*time.Second)
			t.Logf("held tasks answered %s after due", time.Since(due))
			if len(got) != held || time.Now().Before(due) {
				t.Errorf("ETA tasks: %d answered, at %s before due", len(got), time.Until(due))
			}
			checkExactlyOnce(t, fx, held+quick, func(i int) string {
				if i < held {
					return fmt.Sprintf("eta-%d", i)
				}
				return fmt.Sprintf("now-%d", i-held)
			})
		})
	}
}

type stubbornArgs struct {
	Ms int64  `celery:"ms"`
	Op string `celery:"op"`
}

// TestHardTimeLimitWithPython: a task that ignores its context is abandoned
// at its hard time limit: the caller gets TimeLimitExceeded then, not when
// the task returns; a same-database task's transaction is rolled back (also
// when its query ignores the context: the connection is closed under it);
// an outside-mode claim is held at once (policy hold); the soft limit cancels the
// context with ErrSoftTimeLimit.
func TestHardTimeLimitWithPython(t *testing.T) {
	e := newEnv(t)
	pool := testenvPool(t)
	table := pgx.Identifier{e.schema, "effects"}.Sanitize()
	if _, err := pool.Exec(context.Background(), "CREATE TABLE "+table+" (op text)"); err != nil {
		t.Fatal(err)
	}
	ignore := func(ms int64) { time.Sleep(time.Duration(ms) * time.Millisecond) }
	var lateErr = make(chan error, 1)
	reg := NewRegistry()
	for _, err := range []error{
		Register(reg, Task[stubbornArgs]{Name: "t.stubborn", Run: func(_ context.Context, _ *Call, a stubbornArgs) (any, error) {
			ignore(a.Ms)
			return "done", nil
		}}),
		Register(reg, Task[stubbornArgs]{Name: "t.stubborn_default", TimeLimit: 300 * time.Millisecond,
			Run: func(_ context.Context, _ *Call, a stubbornArgs) (any, error) {
				ignore(a.Ms)
				return "done", nil
			}}),
		Register(reg, Task[stubbornArgs]{Name: "t.soft_default", SoftTimeLimit: 200 * time.Millisecond,
			Run: func(ctx context.Context, _ *Call, a stubbornArgs) (any, error) {
				if !pause.For(ctx, time.Duration(a.Ms)*time.Millisecond) {
					return nil, context.Cause(ctx)
				}
				return "done", nil
			}}),
		Register(reg, Task[stubbornArgs]{Name: "t.stubborn_db", Mode: ModeSameDB,
			Key: func(a stubbornArgs) (string, error) { return a.Op, nil },
			RunTx: func(ctx context.Context, tx pgx.Tx, _ *Call, a stubbornArgs) (any, error) {
				if _, err := tx.Exec(ctx, "INSERT INTO "+table+" VALUES ($1)", a.Op); err != nil {
					return nil, err
				}
				ignore(a.Ms)
				_, err := tx.Exec(context.Background(), "INSERT INTO "+table+" VALUES ($1)", a.Op+"-late")
				lateErr <- err
				return "done", err
			}}),
		Register(reg, Task[stubbornArgs]{Name: "t.stubborn_query", Mode: ModeSameDB,
			Key: func(a stubbornArgs) (string, error) { return a.Op, nil },
			RunTx: func(_ context.Context, tx pgx.Tx, _ *Call, a stubbornArgs) (any, error) {
				// A query that ignores the task's context.
				_, err := tx.Exec(context.Background(), "INSERT INTO "+table+" SELECT $1 FROM pg_sleep($2::float8 / 1000)", a.Op, a.Ms)
				return "done", err
			}}),
		Register(reg, Task[stubbornArgs]{Name: "t.stubborn_out", Mode: ModeOutside,
			Key: func(a stubbornArgs) (string, error) { return a.Op, nil },
			Run: func(_ context.Context, _ *Call, a stubbornArgs) (any, error) {
				ignore(a.Ms)
				return "done", nil
			}}),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	cfg := e.config()
	cfg.Pool = pool
	r := e.start(reg, cfg)
	hard := map[string]any{"time_limit": 0.3}
	res := e.calls(
		wfCall{Name: "pure", Task: "t.stubborn", Args: []any{1500, "p"}, Options: hard},
		wfCall{Name: "default", Task: "t.stubborn_default", Args: []any{1500, "d"}},
		wfCall{Name: "soft", Task: "t.soft_default", Args: []any{1500, "s"}},
		wfCall{Name: "db", Task: "t.stubborn_db", Args: []any{1500, "db-1"}, Options: hard},
		wfCall{Name: "query", Task: "t.stubborn_query", Args: []any{5000, "db-2"}, Options: hard},
		wfCall{Name: "outside", Task: "t.stubborn_out", Args: []any{1500, "out-1"}, Options: hard},
		wfCall{Name: "in_time", Task: "t.stubborn", Args: []any{10, "q"}, Options: hard},
	)
	for _, name := range []string{"pure", "default", "db", "outside"} {
		if o := res[name]; o.ExcType != "TimeLimitExceeded" || o.ExcModule != "billiard.exceptions" || o.Message != "0.3" || o.Elapsed > 1.4 {
			t.Errorf("%s: %+v, want TimeLimitExceeded within 1.4 s (the task runs 1.5 s)", name, o)
		}
	}
	if o := res["query"]; o.ExcType != "TimeLimitExceeded" || o.Elapsed > 2.5 {
		t.Errorf("query ignoring its context: %+v, want TimeLimitExceeded within 2.5 s", o)
	}
	if o := res["soft"]; o.ExcType != "SoftTimeLimitExceeded" || o.Elapsed > 1.4 {
		t.Errorf("task soft limit: %+v", o)
	}
	if o := res["in_time"]; string(o.Result) != `"done"` {
		t.Errorf("task within its limit: %+v", o)
	}
	select {
	case err := <-lateErr:
		if !errors.Is(err, pgx.ErrTxClosed) {
			t.Errorf("abandoned task's later query: %v, want ErrTxClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("abandoned same-database task did not return")
	}
	var n int
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM "+table).Scan(&n); err != nil || n != 0 {
		t.Errorf("rows written by abandoned same-database tasks: %d, %v", n, err)
	}
	for _, op := range []string{"db-1", "db-2"} {
		if _, err := e.store.Get(context.Background(), "t.stubborn_db", op); !errors.Is(err, idempotency.ErrNotFound) {
			t.Errorf("record of rolled-back %s: %v", op, err)
		}
	}
	rec, err := e.store.Get(context.Background(), "t.stubborn_out", "out-1")
	if err != nil || rec.Status != idempotency.StatusHeld {
		t.Errorf("outside claim after abandonment: %v, %v (want held at once by its policy, hold)", rec.Status, err)
	}
	for _, task := range []string{"t.stubborn", "t.stubborn_default", "t.stubborn_db", "t.stubborn_query", "t.stubborn_out"} {
		if n := counterValue(r.w.m.abandoned.WithLabelValues(task)); n != 1 {
			t.Errorf("%s abandoned %v times, want 1", task, n)
		}
	}
	if n := counterValue(r.w.m.abandoned.WithLabelValues("t.soft_default")); n != 0 {
		t.Errorf("task stopped by its soft limit counted as abandoned")
	}
	r.stop(t) // waits for the abandoned goroutines
}

// TestETAHeldThroughChannelClose: deliveries held for their ETA when the
// broker closes the consumer's connection (as it does at its
// consumer_timeout) are not lost: the broker redelivers them, the stale
// copies are dropped (the prefetch window shrinks back), and each runs once
// when due.
func TestETAHeldThroughChannelClose(t *testing.T) {
	e := newEnv(t)
	cfg := e.config()
	cfg.Concurrency, cfg.Prefetch = 2, 4
	fx := &effects{}
	r := e.start(testRegistry(t, fx), cfg)
	replyTo, replies := e.replyQueue()
	const held = 6
	// Due late enough that the connection is closed while they are still
	// held: finding it (rabbitmqctl) takes seconds on a loaded machine.
	due := time.Now().Add(20 * time.Second)
	for i := range held {
		m := payMessage("t.pay", i, fmt.Sprintf("eta-%d", i), replyTo)
		m.ETA = due
		e.publish(m)
	}
	testkit.WaitFor(t, "ETA deliveries held", 10*time.Second, func() bool { return len(r.w.Scheduled()) == held })
	pids := testkit.ConnectionPIDs(t, cfg.Broker.Name+" consume")
	if len(pids) == 0 {
		t.Fatal("consumer connection not found")
	}
	testkit.CloseConnections(t, pids)
	testkit.WaitFor(t, "held copies replaced by redeliveries after the reconnect", 15*time.Second, func() bool {
		s := r.w.Scheduled()
		for _, ti := range s {
			if !ti.Redelivered {
				return false
			}
		}
		return len(s) == held && r.w.consumer.Prefetch() == cfg.Prefetch+held
	})
	if time.Now().After(due) {
		t.Fatal("the held copies were replaced only after they were due: the test did not close the connection in time")
	}
	got := results(t, replies, held, 40*time.Second)
	if time.Now().Before(due) {
		t.Errorf("ETA tasks answered %s before due", time.Until(due))
	}
	for i := range held {
		if len(got[taskID(i)]) != 1 || got[taskID(i)][0]["status"] != "SUCCESS" {
			t.Errorf("task %d: %v", i, got[taskID(i)])
		}
	}
	checkExactlyOnce(t, fx, held, func(i int) string { return fmt.Sprintf("eta-%d", i) })
	testkit.WaitFor(t, "queue empty and prefetch back", 10*time.Second, func() bool {
		return e.queueDepth(e.queue) == 0 && r.w.consumer.Prefetch() == cfg.Prefetch
	})
}

// TestLongETARepublished: a delivery due after Config.MaxHold is republished
// and acknowledged at each MaxHold instead of being held past the broker's
// consumer_timeout; it runs once, when due, and the consumer's channel is
// never closed.
func TestLongETARepublished(t *testing.T) {
	e := newEnv(t)
	core, logs := observer.New(zapcore.DebugLevel)
	cfg := e.config()
	cfg.MaxHold = 700 * time.Millisecond
	// A window the memory budget does not cap (the default, 256 deliveries
	// of up to 16 MiB, is capped at what 2 GiB holds): the window in force
	// is then the configured one.
	cfg.Concurrency, cfg.Prefetch = 8, 32
	cfg.Logger = zap.New(zapcore.NewTee(cfg.Logger.Core(), core))
	cfg.Broker.Logger = zap.New(zapcore.NewTee(cfg.Broker.Logger.Core(), core))
	fx := &effects{}
	r := e.start(testRegistry(t, fx), cfg)
	replyTo, replies := e.replyQueue()
	m := payMessage("t.pay", 1, "long-eta", replyTo)
	due := time.Now().Add(3 * time.Second)
	m.ETA = due
	e.publish(m)
	got := results(t, replies, 1, 10*time.Second)
	if time.Now().Before(due) || len(got[m.ID]) != 1 || got[m.ID][0]["status"] != "SUCCESS" {
		t.Errorf("long ETA task: %v, %s before due", got, time.Until(due))
	}
	if n := logs.FilterMessageSnippet("held delivery republished").Len(); n < 3 {
		t.Errorf("republished %d times, want at least 3 (every 700 ms for 3 s)", n)
	}
	if n := logs.FilterMessageSnippet("reconnecting").Len() + logs.FilterMessageSnippet("lost with their channel").Len(); n != 0 {
		t.Errorf("consumer channel lost %d times", n)
	}
	checkExactlyOnce(t, fx, 1, func(int) string { return "long-eta" })
	testkit.WaitFor(t, "queue empty and prefetch back", 10*time.Second, func() bool {
		return e.queueDepth(e.queue) == 0 && r.w.consumer.Prefetch() == r.w.cfg.Prefetch
	})
}

// TestRetriedMessageNotPoison: the claims made by Celery retries do not
// count towards the poison limit of a redelivered message.
func TestRetriedMessageNotPoison(t *testing.T) {
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

// counterValue reads a Prometheus counter.
func counterValue(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		return -1
	}
	return m.GetCounter().GetValue()
}
