package tasks

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/pause"
)

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
		wfCall{Name: "pure", Task: "t.stubborn", Args: []any{3000, "p"}, Options: hard},
		wfCall{Name: "default", Task: "t.stubborn_default", Args: []any{3000, "d"}},
		wfCall{Name: "soft", Task: "t.soft_default", Args: []any{3000, "s"}},
		wfCall{Name: "db", Task: "t.stubborn_db", Args: []any{3000, "db-1"}, Options: hard},
		wfCall{Name: "query", Task: "t.stubborn_query", Args: []any{5000, "db-2"}, Options: hard},
		wfCall{Name: "outside", Task: "t.stubborn_out", Args: []any{3000, "out-1"}, Options: hard},
		wfCall{Name: "in_time", Task: "t.stubborn", Args: []any{10, "q"}, Options: hard},
	)
	for _, name := range []string{"pure", "default", "db", "outside"} {
		if o := res[name]; o.ExcType != "TimeLimitExceeded" || o.ExcModule != "billiard.exceptions" || o.Message != "0.3" || o.Elapsed > 2.5 {
			t.Errorf("%s: %+v, want TimeLimitExceeded within 2.5 s (the task runs 3 s)", name, o)
		}
	}
	if o := res["query"]; o.ExcType != "TimeLimitExceeded" || o.Elapsed > 2.5 {
		t.Errorf("query ignoring its context: %+v, want TimeLimitExceeded within 2.5 s", o)
	}
	if o := res["soft"]; o.ExcType != "SoftTimeLimitExceeded" || o.Elapsed > 2.5 {
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
