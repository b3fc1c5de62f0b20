package tasks

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testkit"
)

// The tests of this file hold the worker to its two promises where the
// database's answer is definite: every message is answered (no error the
// database will give again is retried for ever), and an effect happens once
// (no lease is trusted past what the database says).

type opArgs struct {
	Op string `json:"op"`
}

func opKey(a opArgs) (string, error) { return a.Op, nil }

// TestUnstorableOutcomesAnswered: an outside task whose result holds a NUL,
// one whose error text holds NUL and bytes that are not UTF-8, and one whose
// result is a number beyond PostgreSQL's range are each answered to a real
// Celery caller within seconds, with the record settled (completed, failed,
// held), and the worker keeps serving. The NUL is kept as its escape's text.
func TestUnstorableOutcomesAnswered(t *testing.T) {
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

// TestLongKeyAnsweredAndQuarantined: a real Celery caller of an outside
// task whose operation key is 16 kB (beyond idempotency.MaxKeyBytes; the
// record's index could not keep it) gets TypeError within seconds; the
// message is quarantined as bad arguments, the task never runs, and the
// worker keeps serving.
func TestLongKeyAnsweredAndQuarantined(t *testing.T) {
	e := newEnv(t)
	fx := &effects{}
	e.start(testRegistry(t, fx), e.config())
	start := time.Now()
	res := e.python(2, "json",
		pyCall{Task: "t.pay", Kwargs: map[string]any{"order_id": strings.Repeat("k", 16<<10), "amount": 5}},
		pyCall{Task: "t.pay", Kwargs: map[string]any{"order_id": "fine-1", "amount": 5}, AfterPrevious: true},
	)
	if res[0].ExcType != "TypeError" || !strings.Contains(res[0].Message, "at most 1024 bytes") {
		t.Errorf("long key answered %+v", res[0])
	}
	if !strings.Contains(string(res[1].OK), "fine-1") {
		t.Errorf("worker stopped serving: %+v", res[1])
	}
	if took := time.Since(start); took > 20*time.Second {
		t.Errorf("answers took %s", took)
	}
	q := e.quarantined()
	if len(q) != 1 || q[0].Headers[HeaderReason] != ReasonBadArguments {
		t.Errorf("quarantined %d messages", len(q))
	}
	if got := fx.snapshot(); len(got) != 1 || got["fine-1"] != 1 {
		t.Errorf("effects %v", got)
	}
}

// TestSameDBTaskOwnFailures: a same-database task's failures that come from
// its own work are the task's failures, answered within seconds and never
// retried by the worker as if the database were away: a deferred foreign
// key that fails at COMMIT, a statement error the task caught before
// returning nil, and the task's attempts to commit the transaction itself
// (refused with ErrTxManaged, so its effect commits with its completion;
// through the raw connection, found out and completed). Alone and in a
// transaction group, where the innocent members commit.
func TestSameDBTaskOwnFailures(t *testing.T) {
	for _, group := range []int{0, 8} {
		t.Run(fmt.Sprintf("group%d", group), func(t *testing.T) { sameDBOwnFailures(t, group) })
	}
}

func sameDBOwnFailures(t *testing.T, group int) {
	e := newEnv(t)
	pool := testenvPool(t)
	ctx := context.Background()
	parent, child, uniq := e.schema+".parent", e.schema+".child", e.schema+".uniq"
	for _, q := range []string{
		`CREATE TABLE ` + parent + ` (id int PRIMARY KEY)`,
		`CREATE TABLE ` + child + ` (op text PRIMARY KEY, parent int REFERENCES ` + parent + ` DEFERRABLE INITIALLY DEFERRED)`,
		`CREATE TABLE ` + uniq + ` (v text PRIMARY KEY)`,
		`INSERT INTO ` + uniq + ` VALUES ('taken')`,
	} {
		if _, err := pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	var commitRefused atomic.Int32
	r := NewRegistry()
	reg := func(name string, run func(context.Context, pgx.Tx, opArgs) (any, error)) {
		t.Helper()
		if err := Register(r, Task[opArgs]{Name: name, Mode: ModeSameDB, Key: opKey,
			RunTx: func(ctx context.Context, tx pgx.Tx, _ *Call, a opArgs) (any, error) { return run(ctx, tx, a) }}); err != nil {
			t.Fatal(err)
		}
	}
	insertChild := func(ctx context.Context, tx pgx.Tx, op string, parent int) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+child+` VALUES ($1, $2)`, op, parent)
		return err
	}
	reg("s.deferred_fk", func(ctx context.Context, tx pgx.Tx, a opArgs) (any, error) {
		return "written", insertChild(ctx, tx, a.Op, 999) // no parent 999: refused at COMMIT
	})
	reg("s.swallow", func(ctx context.Context, tx pgx.Tx, a opArgs) (any, error) {
		if err := insertChild(ctx, tx, a.Op, 0); err != nil {
			return nil, err
		}
		_, _ = tx.Exec(ctx, `INSERT INTO `+uniq+` VALUES ('taken')`) // "already there": ignored
		return "done", nil
	})
	reg("s.commit", func(ctx context.Context, tx pgx.Tx, a opArgs) (any, error) {
		if err := insertChild(ctx, tx, a.Op, 0); err != nil {
			return nil, err
		}
		if err := tx.Commit(ctx); errors.Is(err, ErrTxManaged) {
			commitRefused.Add(1)
		}
		if _, err := tx.Exec(ctx, "/* done */ commit"); errors.Is(err, ErrTxManaged) {
			commitRefused.Add(1)
		}
		return "committed by the worker", nil
	})
	reg("s.raw_commit", func(ctx context.Context, tx pgx.Tx, a opArgs) (any, error) {
		if err := insertChild(ctx, tx, a.Op, 0); err != nil {
			return nil, err
		}
		_, err := tx.Conn().Exec(ctx, "COMMIT")
		return "committed by the task", err
	})
	reg("s.good", func(ctx context.Context, tx pgx.Tx, a opArgs) (any, error) {
		return "good", insertChild(ctx, tx, a.Op, 0)
	})
	if _, err := pool.Exec(ctx, `INSERT INTO `+parent+` VALUES (0)`); err != nil {
		t.Fatal(err)
	}
	cfg := e.config()
	cfg.Concurrency = 16
	if group > 0 {
		cfg.Store = e.storeOn(pool, idempotency.BatchConfig{GroupTx: group})
	}
	e.start(r, cfg)
	var calls []pyCall
	for i := range 4 {
		calls = append(calls, pyCall{Task: "s.good", Kwargs: map[string]any{"op": fmt.Sprint("good-", i)}})
	}
	calls = append(calls,
		pyCall{Task: "s.deferred_fk", Kwargs: map[string]any{"op": "fk-1"}},
		pyCall{Task: "s.swallow", Kwargs: map[string]any{"op": "sw-1"}},
		pyCall{Task: "s.commit", Kwargs: map[string]any{"op": "cm-1"}},
		// Alone: a task that commits a group's transaction itself commits
		// (and answers for) the members before it too.
		pyCall{Task: "s.raw_commit", Kwargs: map[string]any{"op": "raw-1"}, AfterPrevious: true},
	)
	for i := range 4 {
		calls = append(calls, pyCall{Task: "s.good", Kwargs: map[string]any{"op": fmt.Sprint("good-", i+4)}, AfterPrevious: i == 0})
	}
	start := time.Now()
	res := e.python(2, "json", calls...)
	if took := time.Since(start); took > 20*time.Second {
		t.Errorf("answers took %s", took)
	}
	byOp := map[string]pyResult{}
	for i, c := range calls {
		byOp[c.Kwargs["op"].(string)] = res[i]
	}
	for op, want := range map[string]string{"fk-1": "violates foreign key constraint", "sw-1": "one of its statements failed"} {
		if r := byOp[op]; r.ExcType != "Exception" || !strings.Contains(r.Message, want) {
			t.Errorf("%s answered %+v, want a failure saying %q", op, r, want)
		}
	}
	// Twice per call of its function (a group may call it again).
	if r, n := byOp["cm-1"], commitRefused.Load(); string(r.OK) != `"committed by the worker"` || n == 0 || n%2 != 0 {
		t.Errorf("cm-1 answered %+v, commits refused %d (want 2 a call)", r, n)
	}
	if r := byOp["raw-1"]; string(r.OK) != `"committed by the task"` {
		t.Errorf("raw-1 answered %+v", r)
	}
	for i := range 8 {
		if r := byOp[fmt.Sprint("good-", i)]; string(r.OK) != `"good"` {
			t.Errorf("good-%d answered %+v", i, r)
		}
	}
	var rows []string
	rs, err := pool.Query(ctx, `SELECT op FROM `+child+` ORDER BY op`)
	if err != nil {
		t.Fatal(err)
	}
	rows, err = pgx.CollectRows(rs, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	want := "[cm-1 good-0 good-1 good-2 good-3 good-4 good-5 good-6 good-7 raw-1]"
	if fmt.Sprint(rows) != want {
		t.Errorf("rows %v, want %s", rows, want)
	}
	for task, op := range map[string]string{"s.commit": "cm-1", "s.raw_commit": "raw-1", "s.good": "good-0"} {
		if rec, err := e.store.Get(ctx, task, op); err != nil || rec.Status != idempotency.StatusCompleted {
			t.Errorf("%s %s: record %v (%v)", task, op, rec.Status, err)
		}
	}
	for task, op := range map[string]string{"s.deferred_fk": "fk-1", "s.swallow": "sw-1"} {
		// None (rolled back), or failed: in a group whose transaction a
		// member ended, its claim may have committed before it ran.
		if rec, err := e.store.Get(ctx, task, op); !errors.Is(err, idempotency.ErrNotFound) && rec.Status != idempotency.StatusFailed {
			t.Errorf("%s %s: record %v (%v), want none or failed", task, op, rec.Status, err)
		}
	}
	// A redelivery of the task that committed itself is a duplicate.
	again := e.python(2, "json", pyCall{Task: "s.raw_commit", Kwargs: map[string]any{"op": "raw-1"}})
	if string(again[0].OK) != `"committed by the task"` {
		t.Errorf("raw-1 again: %+v", again[0])
	}
}

// TestSlowLookupRunsOnce: a stale claim, a lookup policy whose lookup is
// slower than the lease (it reads the outside system, then takes its
// time), and two deliveries of the operation at once: the effect happens
// once. The lookup is cut at its time limit (half the lease) and falls back
// to retry under a lease the database still holds; the second delivery
// finds the operation in progress, then completed. Without the limit, the
// first delivery's lease lapsed during its lookup, the second took the
// operation over, and both ran the effect.
func TestSlowLookupRunsOnce(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	const lease = time.Second
	var effects, lookups atomic.Int32
	r := NewRegistry()
	if err := Register(r, Task[opArgs]{Name: "l.charge", Mode: ModeOutside, Policy: PolicyLookup, Fallback: PolicyRetry,
		Key: opKey, Lease: lease,
		Lookup: func(ctx context.Context, _ *Call, _ opArgs) (any, bool, error) {
			lookups.Add(1)
			found := effects.Load() > 0 // what the outside system says now
			select {                    // then the answer takes its time
			case <-time.After(3 * lease / 2):
			case <-ctx.Done():
				return nil, false, context.Cause(ctx)
			}
			return "found", found, nil
		},
		Run: func(context.Context, *Call, opArgs) (any, error) {
			effects.Add(1)
			return "charged", nil
		}}); err != nil {
		t.Fatal(err)
	}
	// A claim whose worker died: stale by the time the messages arrive.
	p := idempotency.ClaimParams{Task: "l.charge", Key: "op-1", Owner: "dead", TaskID: "dead", Lease: 100 * time.Millisecond}
	if _, err := e.store.Claim(ctx, p); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	cfg := e.config()
	cfg.Concurrency = 4
	e.start(r, cfg)
	replyTo, replies := e.replyQueue()
	for i := range 2 {
		e.publish(&celeryproto.Message{Protocol: 2, Task: "l.charge", ID: taskID(i), Kwargs: map[string]any{"op": "op-1"},
			ReplyTo: replyTo, CorrelationID: taskID(i)})
	}
	res := results(t, replies, 2, 20*time.Second)
	for i := range 2 {
		if rs := res[taskID(i)]; len(rs) != 1 || rs[0]["status"] != "SUCCESS" || rs[0]["result"] != "charged" {
			t.Errorf("delivery %d answered %v", i, rs)
		}
	}
	if n := effects.Load(); n != 1 {
		t.Errorf("effect ran %d times (lookups %d), want once", n, lookups.Load())
	}
}

// TestPoisonCountWaitsForARunningTransaction: a same-database operation
// still running in its transaction while the broker takes its delivery away
// (its connection closed) and hands the copies out again, more often than
// MaxAttempts: the copies wait for the run's outcome instead of being
// quarantined as poison while the run can still commit. The caller is
// answered with the result, never WorkerLostError, and the effect happens
// once.
func TestPoisonCountWaitsForARunningTransaction(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	pool := testenvPool(t)
	table := e.schema + ".slow_effects"
	if _, err := pool.Exec(ctx, `CREATE TABLE `+table+` (op text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	var started, runs atomic.Int32
	r := NewRegistry()
	if err := Register(r, Task[opArgs]{Name: "p.slow", Mode: ModeSameDB, Key: opKey,
		RunTx: func(ctx context.Context, tx pgx.Tx, _ *Call, a opArgs) (any, error) {
			runs.Add(1)
			if _, err := tx.Exec(ctx, `INSERT INTO `+table+` VALUES ($1)`, a.Op); err != nil {
				return nil, err
			}
			if started.Add(1) == 1 {
				<-release // the first run holds its transaction open
			}
			return "slow done", nil
		}}); err != nil {
		t.Fatal(err)
	}
	cfg := e.config()
	cfg.Concurrency, cfg.MaxAttempts = 8, 1
	e.start(r, cfg)
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	t.Cleanup(free) // before the worker stops, if the test fails early
	replyTo, replies := e.replyQueue()
	e.publish(&celeryproto.Message{Protocol: 2, Task: "p.slow", ID: taskID(1), Kwargs: map[string]any{"op": "op-1"},
		ReplyTo: replyTo, CorrelationID: taskID(1)})
	testkit.WaitFor(t, "the first run", 10*time.Second, func() bool { return started.Load() == 1 })
	// Take the delivery away three times: each copy comes back redelivered.
	for range 3 {
		pids := testkit.ConnectionPIDs(t, cfg.Broker.Name)
		if len(pids) == 0 {
			t.Fatal("no worker connection found")
		}
		testkit.CloseConnections(t, pids)
		time.Sleep(700 * time.Millisecond)
	}
	if q := e.quarantined(); len(q) != 0 {
		t.Fatalf("quarantined %d copies while the operation still ran: %v", len(q), q[0].Headers[HeaderReason])
	}
	free()
	res := results(t, replies, 1, 20*time.Second)
	if rs := res[taskID(1)]; rs[0]["status"] != "SUCCESS" || rs[0]["result"] != "slow done" {
		t.Errorf("answered %v", rs)
	}
	testkit.WaitFor(t, "queue empty", 10*time.Second, func() bool { return e.queueDepth(e.queue) == 0 })
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&n); err != nil || n != 1 {
		t.Errorf("%d effects (%v), want 1", n, err)
	}
}

// TestRecheckAsksTheDatabase: a delivery deferred behind a claim in
// progress looks again by the database's clock, not the worker's: with the
// lease still running in the database, it is not taken over however late
// the worker's clock says it is (Record.Live); once it lapses, it is.
func TestRecheckAsksTheDatabase(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	p := idempotency.ClaimParams{Task: "r.t", Key: "k", Owner: "o", TaskID: "x", Lease: 2 * time.Second}
	if _, err := e.store.Claim(ctx, p); err != nil {
		t.Fatal(err)
	}
	rec, err := e.store.Get(ctx, "r.t", "k")
	if err != nil || !rec.Live {
		t.Fatalf("fresh claim: live %v (%v)", rec.Live, err)
	}
	// Move the stored lease end to the worker's past by a clock skew's
	// worth while the database still counts it as running: only the
	// database's comparison stays right (here: the row says 1 s ahead).
	if _, err := testenvPool(t).Exec(ctx, `UPDATE `+e.schema+`.records SET lease_until = now() + interval '1 second'`); err != nil {
		t.Fatal(err)
	}
	if rec, _ = e.store.Get(ctx, "r.t", "k"); !rec.Live {
		t.Error("running lease read as lapsed")
	}
	time.Sleep(1100 * time.Millisecond)
	if rec, _ = e.store.Get(ctx, "r.t", "k"); rec.Live {
		t.Error("lapsed lease read as live")
	}
	recs, err := e.store.List(ctx, idempotency.Filter{Stale: true})
	if err != nil || len(recs) != 1 || recs[0].Key != "k" {
		t.Errorf("stale list %v (%v)", recs, err)
	}
	if n, err := e.store.StaleClaims(ctx); err != nil || n != 1 {
		t.Errorf("stale claims %d (%v)", n, err)
	}
}

// TestRegisterRefusesNamesTheRecordCannotKeep: a task with a record and a
// name beyond idempotency.MaxTaskBytes is refused at registration, not at
// every claim.
func TestRegisterRefusesNamesTheRecordCannotKeep(t *testing.T) {
	long := strings.Repeat("n", idempotency.MaxTaskBytes+1)
	err := Register(NewRegistry(), Task[opArgs]{Name: long, Mode: ModeOutside, Key: opKey,
		Run: func(context.Context, *Call, opArgs) (any, error) { return nil, nil }})
	if !errors.Is(err, ErrInvalidTask) {
		t.Errorf("long name registered: %v", err)
	}
	if err := Register(NewRegistry(), Task[opArgs]{Name: long, Run: func(context.Context, *Call, opArgs) (any, error) { return nil, nil }}); err != nil {
		t.Errorf("long name of a pure task (no record): %v", err)
	}
}

func TestEndsTx(t *testing.T) {
	for sql, want := range map[string]bool{
		"COMMIT":                          true,
		" /* x */ -- y\n commit work":     true,
		"end":                             true,
		"ABORT":                           true,
		"rollback":                        true,
		"ROLLBACK AND CHAIN":              true,
		"rollback to savepoint a":         false,
		"ROLLBACK WORK TO a":              false,
		"prepare transaction 'x'":         true,
		"PREPARE transaction AS SELECT 1": false,
		"COMMIT PREPARED 'x'":             true,
		"INSERT INTO t VALUES (1); COMMIT AND CHAIN": true,
		"INSERT INTO t VALUES (1); ROLLBACK":         true,
		"SELECT 1; SELECT 2":                         false,
		"SELECT ';commit'":                           false,
		`SELECT "a;commit"`:                          false,
		"SELECT E'\\';commit'":                       false,
		"SELECT $$;commit$$":                         false,
		"SELECT $f$;commit$f$; SELECT 1":             false,
		"SELECT $1; SELECT 2":                        false,
		"SELECT 1 /* ; commit */":                    false,
		"SELECT 1 -- ; commit":                       false,
		"SELECT 1 /* /* */ ; commit */":              false,
		"UPDATE endpoint SET x = 1":                  false,
		"SELECT end_of_day()":                        false,
		"INSERT INTO commit_log VALUES (1)":          false,
		"SELECT 1; end":                              true,
	} {
		if got := endsTx(sql); got != want {
			t.Errorf("endsTx(%q) = %v, want %v", sql, got, want)
		}
	}
}
