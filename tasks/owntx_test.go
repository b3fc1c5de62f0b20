package tasks

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/internal/workerhooks"
)

// TestNoRecordSameDB: without the record a same-database task runs its
// RunTx in a transaction of its own: each copy commits its effect (3 copies,
// 3 rows), a failing task commits nothing, nothing is recorded, and the
// crash points are reached (after_effect before the commit).
func TestNoRecordSameDB(t *testing.T) {
	t.Parallel()
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

// TestNoRecord: without the record every copy runs: 3 copies, 3 effects.
func TestNoRecord(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := &effects{}
	cfg := e.config()
	cfg.hooks.NoRecord, cfg.Store = true, nil
	e.start(testRegistry(t, fx), cfg)
	replyTo, replies := e.replyQueue()
	for i := range 3 {
		e.publish(payMessage("t.pay", i, "nr-1", replyTo))
	}
	results(t, replies, 3, 20*time.Second)
	if n := fx.snapshot()["nr-1"]; n != 3 {
		t.Errorf("%d effects without the record, want 3", n)
	}
}
