package tasks

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/idempotency"
)

// TestSameDBTaskOwnFailures: a same-database task's failures that come from
// its own work are the task's failures, answered within seconds and never
// retried by the worker as if the database were away: a deferred foreign
// key that fails at COMMIT, a statement error the task caught before
// returning nil, and the task's attempts to commit the transaction itself
// (refused with ErrTxManaged, so its effect commits with its completion;
// through the raw connection, found out and completed). Alone and in a
// transaction group, where the innocent members commit.
func TestSameDBTaskOwnFailures(t *testing.T) {
	t.Parallel()
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

func TestEndsTx(t *testing.T) {
	t.Parallel()
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
		"SELECT 1 -- x\r; COMMIT":                    true,
		"-- x\rCOMMIT /*\n*/":                        true,
		"/* a /* b */ ; commit */ SELECT 1":          false,
	} {
		if got := endsTx(sql); got != want {
			t.Errorf("endsTx(%q) = %v, want %v", sql, got, want)
		}
	}
}
