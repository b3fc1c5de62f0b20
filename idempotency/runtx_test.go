package idempotency_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/idempotency"
)

// effects is the table a same-database task writes its effect to.
func (e *env) effects(t *testing.T) string {
	t.Helper()
	tbl := e.schema + ".effects"
	if _, err := e.pool.Exec(context.Background(),
		`CREATE TABLE IF NOT EXISTS `+tbl+` (key text NOT NULL, amount int NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	return tbl
}

func (e *env) count(t *testing.T, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := e.pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestRunTxEffectOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{})
	tbl := e.effects(t)
	ctx := context.Background()
	p := params("credit", "op1")

	run := func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ($1, 10)`, "op1"); err != nil {
			return nil, err
		}
		return []byte(`{"credited":10}`), nil
	}
	c, err := e.store.RunTx(ctx, p, run)
	if err != nil {
		t.Fatal(err)
	}
	if c.Outcome != idempotency.OutcomeFirst || c.Status != idempotency.StatusCompleted {
		t.Fatalf("first run %+v", c)
	}
	c, err = e.store.RunTx(ctx, p, run)
	if err != nil {
		t.Fatal(err)
	}
	if c.Outcome != idempotency.OutcomeCompleted || string(c.Result) != `{"credited": 10}` {
		t.Fatalf("second run %+v", c)
	}
	if n := e.count(t, `SELECT count(*) FROM `+tbl); n != 1 {
		t.Fatalf("%d effects", n)
	}
	if r := e.get(t, "credit", "op1"); r.Duplicates != 1 {
		t.Fatalf("duplicates %d", r.Duplicates)
	}
}

func TestRunTxRollbackLeavesNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{})
	tbl := e.effects(t)
	ctx := context.Background()
	p := params("credit", "op")
	boom := errors.New("boom")
	_, err := e.store.RunTx(ctx, p, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ('op', 1)`); err != nil {
			return nil, err
		}
		return nil, boom
	})
	if !errors.Is(err, boom) {
		t.Fatalf("err %v", err)
	}
	if _, err := e.store.Get(ctx, "credit", "op"); !errors.Is(err, idempotency.ErrNotFound) {
		t.Fatalf("record after rollback: %v", err)
	}
	if n := e.count(t, `SELECT count(*) FROM `+tbl); n != 0 {
		t.Fatalf("%d effects after rollback", n)
	}
	// The next delivery runs it.
	c, err := e.store.RunTx(ctx, p, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		_, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ('op', 1)`)
		return nil, err
	})
	if err != nil || c.Outcome != idempotency.OutcomeFirst || c.Attempt != 1 {
		t.Fatalf("rerun %+v %v", c, err)
	}
}

func TestRunTxConcurrentDuplicateBlocksThenSeesCompleted(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{})
	tbl := e.effects(t)
	ctx := context.Background()
	p := params("credit", "hot")
	inside := make(chan struct{})
	release := make(chan struct{})
	var runs atomic.Int32
	var wg sync.WaitGroup
	var first idempotency.Claim
	wg.Go(func() {
		var err error
		first, err = e.store.RunTx(ctx, p, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			runs.Add(1)
			close(inside)
			<-release
			_, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ('hot', 5)`)
			return []byte(`5`), err
		})
		if err != nil {
			t.Error(err)
		}
	})
	<-inside
	var dup idempotency.Claim
	dupDone := make(chan struct{})
	wg.Go(func() {
		defer close(dupDone)
		var err error
		dup, err = e.store.RunTx(ctx, p, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			runs.Add(1)
			_, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ('hot', 5)`)
			return nil, err
		})
		if err != nil {
			t.Error(err)
		}
	})
	select {
	case <-dupDone:
		t.Fatal("duplicate did not block on the open claim")
	case <-time.After(300 * time.Millisecond):
	}
	close(release)
	wg.Wait()
	if first.Outcome != idempotency.OutcomeFirst || dup.Outcome != idempotency.OutcomeCompleted || string(dup.Result) != "5" {
		t.Fatalf("first %+v dup %+v", first, dup)
	}
	if runs.Load() != 1 || e.count(t, `SELECT count(*) FROM `+tbl) != 1 {
		t.Fatalf("runs %d", runs.Load())
	}
}

// TestRunTxCrashBeforeCommit kills the transaction's connection after the
// effect (as a crashed worker would lose it): nothing is committed, and the
// redelivery runs the task once.
func TestRunTxCrashBeforeCommit(t *testing.T) {
	e := newEnv(t, idempotency.BatchConfig{})
	tbl := e.effects(t)
	ctx := context.Background()
	p := params("credit", "crash")
	_, err := e.store.RunTx(ctx, p, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		var pid int
		if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
			return nil, err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ('crash', 1)`); err != nil {
			return nil, err
		}
		// This test's own connection, ended from outside.
		if _, err := e.pool.Exec(ctx, `SELECT pg_terminate_backend($1, 5000)`, pid); err != nil {
			return nil, err
		}
		return []byte(`1`), nil
	})
	if err == nil || idempotency.IsUnknownOutcome(err) {
		t.Fatalf("run tx on a killed connection: %v, want a definite error", err)
	}
	if _, err := e.store.Get(ctx, "credit", "crash"); !errors.Is(err, idempotency.ErrNotFound) {
		t.Fatalf("record after crash: %v", err)
	}
	if n := e.count(t, `SELECT count(*) FROM `+tbl); n != 0 {
		t.Fatalf("%d effects after crash", n)
	}
	c, err := e.store.RunTx(ctx, p, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		_, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ('crash', 1)`)
		return []byte(`1`), err
	})
	if err != nil || c.Outcome != idempotency.OutcomeFirst || e.count(t, `SELECT count(*) FROM `+tbl) != 1 {
		t.Fatalf("redelivery %+v %v", c, err)
	}
}

func TestClosedStore(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{})
	e.store.Close()
	e.store.Close()
	if _, err := e.store.Claim(context.Background(), params("t", "k")); !errors.Is(err, idempotency.ErrClosed) {
		t.Fatalf("claim on closed store: %v", err)
	}
}

// TestRunTxEndedThenFailedHeldWithMessage: a function that commits the
// transaction itself and then fails leaves its claim and effect
// committed; the operation is held with the caller's message (Message, or
// what HeldMessage makes), which its claim, written in the transaction,
// did not store. Alone and in a transaction group.
func TestRunTxEndedThenFailedHeldWithMessage(t *testing.T) {
	t.Parallel()
	for _, group := range []int{0, 4} {
		for _, lazy := range []bool{false, true} {
			e := newEnv(t, idempotency.BatchConfig{GroupTx: group, GroupFlushers: 1})
			tbl := e.effects(t)
			ctx := context.Background()
			p := params("credit", "ended")
			want := string(p.Message)
			if lazy {
				msg := p.Message
				p.Message, p.HeldMessage = nil, func() []byte { return msg }
			}
			boom := errors.New("boom")
			_, err := e.store.RunTx(ctx, p, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				if _, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ('ended', 1)`); err != nil {
					return nil, err
				}
				if _, err := tx.Conn().Exec(ctx, "COMMIT"); err != nil {
					return nil, err
				}
				return nil, boom
			})
			if !errors.Is(err, boom) {
				t.Fatalf("group %d lazy %v: err %v, want the function's", group, lazy, err)
			}
			r := e.get(t, "credit", "ended")
			if r.Status != idempotency.StatusHeld || string(r.Message) != want {
				t.Fatalf("group %d lazy %v: record %s with message %q, want held with %q", group, lazy, r.Status, r.Message, want)
			}
			if n := e.count(t, `SELECT count(*) FROM `+tbl); n != 1 {
				t.Fatalf("%d effects", n)
			}
		}
	}
}
