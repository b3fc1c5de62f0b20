package tasks

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/testkit"
	"github.com/onceler/onceler/internal/workerhooks"
)

// TestCrashPointsPure: a pure task reaches after_claim before it runs and
// after_effect after it returned (the kill is recorded instead of executed).
func TestCrashPointsPure(t *testing.T) {
	for _, at := range []string{workerhooks.AfterClaim, workerhooks.AfterEffect, workerhooks.BeforeAck} {
		t.Run(at, func(t *testing.T) {
			e := newEnv(t)
			var ran atomic.Int32
			reg := NewRegistry()
			if err := Register(reg, Task[addArgs]{Name: "t.add", Run: func(_ context.Context, _ *Call, a addArgs) (any, error) {
				ran.Add(1)
				return a.X + a.Y, nil
			}}); err != nil {
				t.Fatal(err)
			}
			cfg := e.config()
			cfg.hooks.Crash = workerhooks.Crash{At: at, Task: "t.add"}
			cfg.Concurrency = 1
			w, err := NewWorker(reg, cfg)
			if err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			var seen []string
			w.kill = func() {
				mu.Lock()
				defer mu.Unlock()
				seen = append(seen, fmt.Sprintf("ran=%d", ran.Load()))
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- w.Run(ctx) }()
			defer func() {
				cancel()
				if err := <-done; err != nil {
					t.Error(err)
				}
			}()
			replyTo, replies := e.replyQueue()
			for i := range 2 {
				e.publish(&celeryproto.Message{Protocol: 2, Task: "t.add", ID: taskID(i), Args: []any{int64(1), int64(2)}, ReplyTo: replyTo})
			}
			results(t, replies, 2, 20*time.Second)
			mu.Lock()
			defer mu.Unlock()
			want := map[string]string{workerhooks.AfterClaim: "ran=0", workerhooks.AfterEffect: "ran=1", workerhooks.BeforeAck: "ran=1"}[at]
			if len(seen) != 1 || seen[0] != want {
				t.Errorf("kill calls %v, want one with %s", seen, want)
			}
		})
	}
}

// TestNoRecordSameDB: without the record a same-database task runs its
// RunTx in a transaction of its own: each copy commits its effect (3 copies,
// 3 rows), a failing task commits nothing, nothing is recorded, and the
// crash points are reached (after_effect before the commit).
func TestNoRecordSameDB(t *testing.T) {
	e := newEnv(t)
	pool := testenvPool(t)
	table := pgx.Identifier{e.schema, "nr_ledger"}.Sanitize()
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE TABLE `+table+` (entry text NOT NULL, task_id text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	reg := NewRegistry()
	if err := Register(reg, Task[payArgs]{Name: "t.credit", Mode: ModeSameDB,
		Key: func(a payArgs) (string, error) { return a.OrderID, nil },
		RunTx: func(ctx context.Context, tx pgx.Tx, c *Call, a payArgs) (any, error) {
			if _, err := tx.Exec(ctx, `INSERT INTO `+table+` VALUES ($1, $2)`, a.OrderID, c.TaskID); err != nil {
				return nil, err
			}
			if strings.HasPrefix(a.OrderID, "bad") {
				return nil, ValueError("refused after the insert")
			}
			return map[string]any{"entry": a.OrderID}, nil
		}}); err != nil {
		t.Fatal(err)
	}
	cfg := e.config()
	cfg.hooks.NoRecord, cfg.Store = true, nil
	if _, err := NewWorker(reg, cfg); err == nil {
		t.Fatal("NoRecord worker with a same-database task and no Pool accepted")
	}
	cfg.Pool = pool
	cfg.hooks.Crash = workerhooks.Crash{At: workerhooks.AfterEffect, Task: "t.credit"}
	cfg.Concurrency = 1
	w, err := NewWorker(reg, cfg)
	if err != nil {
		t.Fatal(err)
	}
	var kills atomic.Int32
	rows := -1
	w.kill = func() {
		kills.Add(1)
		// after_effect: the effect is written, not yet committed.
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&rows)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- w.Run(runCtx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	replyTo, replies := e.replyQueue()
	for i := range 3 {
		e.publish(payMessage("t.credit", i, "nr-1", replyTo))
	}
	e.publish(payMessage("t.credit", 3, "bad-1", replyTo))
	res := results(t, replies, 4, 20*time.Second)
	for i := range 3 {
		if r := res[taskID(i)][0]; r["status"] != "SUCCESS" {
			t.Errorf("copy %d: %v, want SUCCESS", i, r)
		}
	}
	if r := res[taskID(3)][0]; r["status"] != "FAILURE" || !strings.Contains(fmt.Sprint(r["result"]), "ValueError") {
		t.Errorf("failing task: %v, want FAILURE ValueError", r)
	}
	var good, bad int
	if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE entry = 'nr-1'), count(*) FILTER (WHERE entry = 'bad-1') FROM `+table).Scan(&good, &bad); err != nil {
		t.Fatal(err)
	}
	if good != 3 || bad != 0 {
		t.Errorf("rows: %d for the 3 copies (want 3), %d for the failed task (want 0)", good, bad)
	}
	if _, err := e.store.Get(ctx, "t.credit", "nr-1"); err == nil {
		t.Error("an operation was recorded without the record")
	}
	if kills.Load() != 1 || rows != 0 {
		t.Errorf("after_effect kills %d with %d committed rows, want 1 with 0", kills.Load(), rows)
	}
}

// TestHeldAndSkippedAnswerPython: a Python caller whose operation is found
// held (or skipped) gets a FAILURE at once and raises the exception class
// named OperationHeld (OperationSkipped), which Celery makes for the
// unimportable module onceler.exceptions; the deliveries are acknowledged.
func TestHeldAndSkippedAnswerPython(t *testing.T) {
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

// TestRevokedSetExpires: revoked ids are forgotten after their expiry, the
// oldest first when the set is full, and a re-revoked id lives again.
func TestRevokedSetExpires(t *testing.T) {
	now := time.Unix(1000, 0)
	s := newRevokedSet(3, time.Hour)
	s.now = func() time.Time { return now }
	s.add("a")
	now = now.Add(30 * time.Minute)
	s.add("b")
	if !s.has("a") || !s.has("b") {
		t.Fatal("fresh ids missing")
	}
	now = now.Add(31 * time.Minute)
	if s.has("a") || !s.has("b") || s.len() != 1 {
		t.Fatalf("after 61 min: a %v b %v len %d, want a expired", s.has("a"), s.has("b"), s.len())
	}
	s.add("b") // revoked again: expires an hour from now
	now = now.Add(45 * time.Minute)
	if !s.has("b") {
		t.Fatal("re-revoked id expired early")
	}
	for _, id := range []string{"c", "d", "e"} {
		s.add(id)
	}
	if s.has("b") || !s.has("c") || !s.has("e") || s.len() != 3 {
		t.Fatalf("full set kept the oldest: len %d", s.len())
	}
	for range 1000 {
		s.add("e")
	}
	if len(s.order) > 2*s.len()+64 {
		t.Fatalf("order grew to %d entries for %d ids", len(s.order), s.len())
	}
}

// TestRevokedExpiry: a revoked id is refused (REVOKED) until
// Config.RevokedExpiry has passed; then the same id runs.
func TestRevokedExpiry(t *testing.T) {
	e := newEnv(t)
	cfg := e.config()
	cfg.RevokedExpiry = 500 * time.Millisecond
	r := e.start(testRegistry(t, &effects{}), cfg)
	replyTo, replies := e.replyQueue()
	r.w.Revoke([]string{taskID(1)}, false)
	msg := &celeryproto.Message{Protocol: 2, Task: "t.add", ID: taskID(1), Args: []any{int64(1), int64(2)}, ReplyTo: replyTo}
	e.publish(msg)
	if got := results(t, replies, 1, 20*time.Second)[taskID(1)][0]; got["status"] != "REVOKED" {
		t.Fatalf("revoked id: %v, want REVOKED", got)
	}
	time.Sleep(600 * time.Millisecond)
	e.publish(msg)
	if got := results(t, replies, 1, 20*time.Second)[taskID(1)][0]; got["status"] != "SUCCESS" {
		t.Fatalf("after the expiry: %v, want SUCCESS", got)
	}
}

// gatedRecorder is an Observer with control.Controller's TaskEvents switch.
type gatedRecorder struct {
	recorder
	on    atomic.Bool
	asked atomic.Int32
}

func (g *gatedRecorder) TaskEvents() bool { g.asked.Add(1); return g.on.Load() }

// TestTaskEventFields: with task events off the Observer gets nothing (no
// field maps are built); on, task-succeeded carries runtime (float seconds)
// and result (a Python repr), task-failed exception and a string traceback.
func TestTaskEventFields(t *testing.T) {
	e := newEnv(t)
	rec := &gatedRecorder{}
	cfg := e.config()
	cfg.Observer, cfg.Concurrency = rec, 1
	reg := testRegistry(t, &effects{})
	if err := Register(reg, Task[addArgs]{Name: "t.map", Run: func(context.Context, *Call, addArgs) (any, error) {
		return map[string]any{"ok": true, "n": nil, "s": "it's"}, nil
	}}); err != nil {
		t.Fatal(err)
	}
	e.start(reg, cfg)
	e.python(2, "json", pyCall{Task: "t.add", Args: []any{1, 2}})
	rec.mu.Lock()
	n := len(rec.events)
	rec.mu.Unlock()
	if n != 0 || rec.asked.Load() == 0 {
		t.Fatalf("events off: %d events, TaskEvents asked %d times", n, rec.asked.Load())
	}
	rec.on.Store(true)
	res := e.python(2, "json",
		pyCall{Task: "t.add", Args: []any{1, 2}},
		pyCall{Task: "t.map", Args: []any{1, 2}},
		pyCall{Task: "t.fail_value", Args: []any{1, 2}},
	)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	byType := map[string]map[string]any{}
	for _, ev := range rec.events {
		byType[fmt.Sprint(ev["type"], ":", ev["uuid"])] = ev
	}
	for i, want := range []string{"3", `{'n': None, 'ok': True, 's': "it's"}`} {
		ev := byType["task-succeeded:"+res[i].ID]
		if ev == nil {
			t.Fatalf("no task-succeeded for call %d in %v", i, rec.events)
		}
		if rt, ok := ev["runtime"].(float64); !ok || rt < 0 || rt > 5 {
			t.Errorf("runtime %#v, want float seconds", ev["runtime"])
		}
		if ev["result"] != want {
			t.Errorf("result %#v, want %q", ev["result"], want)
		}
	}
	ev := byType["task-failed:"+res[2].ID]
	if ev == nil {
		t.Fatalf("no task-failed in %v", rec.events)
	}
	tb, ok := ev["traceback"].(string)
	if ev["exception"] != "ValueError('x must be positive')" || !ok || !strings.Contains(tb, "t.fail_value") ||
		!strings.HasSuffix(tb, "ValueError: x must be positive\n") {
		t.Errorf("task-failed exception %#v traceback %#v", ev["exception"], ev["traceback"])
	}
}

func TestResultRepr(t *testing.T) {
	for in, want := range map[string]string{
		`null`: "None", `1.5`: "1.5", `2`: "2", `"a'b"`: `"a'b"`, `"a'\"b"`: `'a\'"b'`, `[1,"x\n"]`: `[1, 'x\n']`,
		`{"b":false,"a":[]}`: `{'a': [], 'b': False}`, `1e300`: "1e+300",
	} {
		if got := resultRepr([]byte(in)); got != want {
			t.Errorf("repr(%s) = %s, want %s", in, got, want)
		}
	}
	if got := resultRepr([]byte(`"` + strings.Repeat("x", 3000) + `"`)); len(got) != 1024 || !strings.HasSuffix(got, "...") {
		t.Errorf("long repr: %d bytes", len(got))
	}
}
