package tasks

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceler/onceler/idempotency"
)

// TestUnstorableOutcomesAnswered: an outside task whose result holds a NUL,
// one whose error text holds NUL and bytes that are not UTF-8, and one whose
// result is a number beyond PostgreSQL's range are each answered to a real
// Celery caller within seconds, with the record settled (completed, failed,
// held), and the worker keeps serving. The NUL is kept as its escape's text.
func TestUnstorableOutcomesAnswered(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := NewRegistry()
	var runs atomic.Int32
	for name, run := range map[string]func() (any, error){
		"g.nul_result": func() (any, error) { return map[string]any{"text": "a\x00b"}, nil },
		"g.nul_error":  func() (any, error) { return nil, errors.New("bad\x00input\xff") },
		"g.huge":       func() (any, error) { return json.RawMessage(`1e999999`), nil },
	} {
		if err := Register(r, Task[opArgs]{Name: name, Mode: ModeOutside, Policy: PolicyRetry, Key: opKey,
			Run: func(context.Context, *Call, opArgs) (any, error) { runs.Add(1); return run() }}); err != nil {
			t.Fatal(err)
		}
	}
	if err := Register(r, Task[addArgs]{Name: "t.add", Run: func(_ context.Context, _ *Call, a addArgs) (any, error) {
		return a.X + a.Y, nil
	}}); err != nil {
		t.Fatal(err)
	}
	e.start(r, e.config())
	start := time.Now()
	res := e.python(2, "json",
		pyCall{Task: "g.nul_result", Kwargs: map[string]any{"op": "n-1"}},
		pyCall{Task: "g.nul_error", Kwargs: map[string]any{"op": "e-1"}},
		pyCall{Task: "g.huge", Kwargs: map[string]any{"op": "h-1"}},
		pyCall{Task: "t.add", Args: []any{2, 3}, AfterPrevious: true},
	)
	took := time.Since(start)
	if got := string(res[0].OK); got != `{"text": "a\\u0000b"}` {
		t.Errorf("NUL result: %s %s %s", got, res[0].ExcType, res[0].Message)
	}
	if res[1].ExcType != "Exception" || !strings.HasPrefix(res[1].Message, "bad\x00input") {
		t.Errorf("NUL error: %+v", res[1])
	}
	if res[2].ExcType != "ResultNotStored" || !strings.Contains(res[2].Message, "refused its result") {
		t.Errorf("unstorable number: %+v", res[2])
	}
	if string(res[3].OK) != "5" {
		t.Errorf("worker stopped serving: %+v", res[3])
	}
	if took > 20*time.Second {
		t.Errorf("answers took %s", took)
	}
	ctx := context.Background()
	for task, want := range map[string]idempotency.Status{"g.nul_result": idempotency.StatusCompleted,
		"g.nul_error": idempotency.StatusFailed, "g.huge": idempotency.StatusHeld} {
		key := map[string]string{"g.nul_result": "n-1", "g.nul_error": "e-1", "g.huge": "h-1"}[task]
		rec, err := e.store.Get(ctx, task, key)
		if err != nil || rec.Status != want {
			t.Errorf("%s: record %v (%v), want %s", task, rec.Status, err, want)
		}
	}
	// A duplicate of the completed one gets the stored result, the same.
	again := e.python(2, "json", pyCall{Task: "g.nul_result", Kwargs: map[string]any{"op": "n-1"}})
	if string(again[0].OK) != string(res[0].OK) {
		t.Errorf("duplicate answered %s, first %s", again[0].OK, res[0].OK)
	}
	if n := runs.Load(); n != 3 {
		t.Errorf("%d runs, want 3", n)
	}
}
