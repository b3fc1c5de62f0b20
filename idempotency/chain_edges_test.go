package idempotency_test

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/idempotency"
)

// TestFailedRunDoesNotWaitForThePool: a well-behaved same-database task
// that fails (its own error, or its caller's context ending) while every
// connection of the pool is wanted by others returns at once with its own
// definite error: asking the record what of its transaction committed
// takes no other connection.
func TestFailedRunDoesNotWaitForThePool(t *testing.T) {
	t.Parallel()
	boom := errors.New("boom")
	for name, cancelled := range map[string]bool{"task error": false, "caller cancelled": true} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, idempotency.BatchConfig{})
			tbl := e.effects(t)
			pe := e.over(t, func(cfg *pgxpool.Config) { cfg.MaxConns = 1 },
				idempotency.BatchConfig{Disabled: true, GroupTx: 1})
			ctx := context.Background()
			var cancel context.CancelFunc = func() {}
			if cancelled {
				ctx, cancel = context.WithTimeout(ctx, 300*time.Millisecond)
			}
			defer cancel()
			hold := make(chan struct{})
			var wg sync.WaitGroup
			defer wg.Wait()
			defer close(hold)
			start := time.Now()
			_, err := pe.store.RunTx(ctx, params("pool", "k"), func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				if _, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ('k', 1)`); err != nil {
					return nil, err
				}
				// Another of the worker's goroutines wants a connection.
				wg.Go(func() {
					c, err := pe.pool.Acquire(context.Background())
					if err != nil {
						return
					}
					<-hold
					c.Release()
				})
				time.Sleep(100 * time.Millisecond)
				if cancelled {
					<-ctx.Done()
					return nil, ctx.Err()
				}
				return nil, boom
			})
			took := time.Since(start)
			t.Logf("RunTx returned after %v: %v (unknown outcome: %v)", took.Round(time.Millisecond), err, idempotency.IsUnknownOutcome(err))
			if took > 2*time.Second {
				t.Errorf("a failed run returned %v after it began (its own failure came within 0.3 s)", took.Round(time.Millisecond))
			}
			if idempotency.IsUnknownOutcome(err) {
				t.Errorf("a run that rolled back, nothing committed, answered with an unknown outcome: %v", err)
			}
			if n := e.count(t, `SELECT count(*) FROM `+tbl); n != 0 {
				t.Errorf("%d effects", n)
			}
		})
	}
}

// TestDeferringMemberNotRunTwiceWhenAnotherEnds: member a writes on tx,
// then defers its statement; member b, after it, commits the transaction
// itself, with a's write. Defer refuses a function that already used its
// transaction (a runs its statement itself), so a is not run again in
// full: its write lands once.
func TestDeferringMemberNotRunTwiceWhenAnotherEnds(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{GroupTx: 32, GroupFlushers: 1})
	tbl := e.effects(t)
	errs := runQueued(t, e, "dfe", map[string]func(context.Context, pgx.Tx) ([]byte, error){
		"a": func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			if _, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ('a-pre', 1)`); err != nil {
				return nil, err
			}
			sql := `INSERT INTO ` + tbl + ` VALUES ('a', 1)`
			if idempotency.Defer(ctx, idempotency.Deferred{SQL: sql}) {
				return nil, nil
			}
			_, err := tx.Exec(ctx, sql)
			return nil, err
		},
		"b": func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			if _, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ('b', 1)`); err != nil {
				return nil, err
			}
			_, err := tx.Conn().Exec(ctx, "COMMIT")
			return nil, err
		},
	})
	if st := e.store.BatchStats(); st.TxGroups == 0 {
		t.Fatalf("stats %+v: the calls did not run as a group", st)
	}
	pre := e.count(t, `SELECT count(*) FROM `+tbl+` WHERE key = 'a-pre'`)
	r := e.get(t, "dfe", "a")
	t.Logf("a: %s, a-pre written %d times, err %v", r.Status, pre, errs["a"])
	if pre > 1 {
		t.Errorf("a's write before its Defer landed %d times (record %s, err %v)", pre, r.Status, errs["a"])
	}
}

// stmtCounter counts the statements a pool sends whose text contains sub.
type stmtCounter struct {
	sub string
	n   atomic.Int64
}

func (c *stmtCounter) see(sql string) {
	if strings.Contains(sql, c.sub) {
		c.n.Add(1)
	}
}

func (c *stmtCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	c.see(d.SQL)
	return ctx
}
func (c *stmtCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (c *stmtCounter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}
func (c *stmtCounter) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	c.see(d.SQL)
}
func (c *stmtCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// TestMemberByMemberSuccessSendsNoUnusedStatement: a group that runs
// member by member (a member allows a mismatch) and succeeds sends no
// transaction-id statement: its savepoints, not the id, show a function
// that ended the transaction.
func TestMemberByMemberSuccessSendsNoUnusedStatement(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{})
	tbl := e.effects(t)
	ctr := &stmtCounter{sub: "pg_current_xact_id"}
	pe := e.over(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.Tracer = ctr },
		idempotency.BatchConfig{GroupTx: 32, GroupFlushers: 1})
	var mu sync.Mutex
	errs := map[string]error{}
	var calls []func()
	for _, k := range []string{"m0", "m1", "m2"} {
		calls = append(calls, func() {
			p := params("mbm", k)
			p.AllowMismatch = true
			_, err := pe.store.RunTx(context.Background(), p, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				_, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ($1, 1)`, k)
				return nil, err
			})
			mu.Lock()
			errs[k] = err
			mu.Unlock()
		})
	}
	queued(t, pe, calls)
	if st := pe.store.BatchStats(); st.TxGroups == 0 {
		t.Fatalf("stats %+v: the calls did not run as a group", st)
	}
	for k, err := range errs {
		if err != nil {
			t.Fatalf("%s: %v", k, err)
		}
	}
	if n := ctr.n.Load(); n != 0 {
		t.Errorf("a member-by-member group's success sent %d transaction-id statements it does not use", n)
	}
}

// TestSameTokenRetryAfterUnknownDoesNotRunTwice: a caller of RunTx that
// tries again with the same token after an unknown outcome (as the Token
// doc allows) does not run an effect twice: a task committed part of its
// transaction (COMMIT AND CHAIN: its claim and its effect), then the
// worker's commit was cut off; RunTx's claims never take a claimed record
// for their own, so the retry finds it in progress.
func TestSameTokenRetryAfterUnknownDoesNotRunTwice(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{})
	tbl := e.effects(t)
	bad := e.schema + ".bad"
	bg := context.Background()
	for _, q := range []string{
		`CREATE TABLE ` + bad + ` (k int)`,
		`CREATE FUNCTION ` + e.schema + `.slow_fail() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(2); RAISE EXCEPTION 'refused'; END $$`,
		`CREATE CONSTRAINT TRIGGER slow_fail AFTER INSERT ON ` + bad +
			` DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION ` + e.schema + `.slow_fail()`,
	} {
		if _, err := e.pool.Exec(bg, q); err != nil {
			t.Fatal(err)
		}
	}
	var cut atomic.Bool
	s := e.over(t, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			if cut.Load() {
				return nil, errors.New("network unreachable")
			}
			var d net.Dialer
			return d.DialContext(ctx, network, addr)
		}
	}, idempotency.BatchConfig{Disabled: true, GroupTx: 1}).store
	p := params("same", "k")
	p.Token = idempotency.NewToken()
	var calls atomic.Int32
	fn := func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ('k', 1)`); err != nil {
			return nil, err
		}
		if calls.Add(1) > 1 {
			return nil, nil
		}
		if _, err := tx.Conn().Exec(ctx, "COMMIT AND CHAIN"); err != nil {
			return nil, err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO `+bad+` VALUES (1)`); err != nil {
			return nil, err
		}
		cut.Store(true) // the cancel request will not get through
		return nil, nil
	}
	ctx, cancel := context.WithTimeout(bg, 700*time.Millisecond)
	_, err := s.RunTx(ctx, p, fn)
	cancel()
	cut.Store(false)
	t.Logf("first attempt: %v (unknown outcome: %v)", err, idempotency.IsUnknownOutcome(err))
	if !idempotency.IsUnknownOutcome(err) {
		t.Skipf("the first attempt's outcome is not unknown: %v", err)
	}
	time.Sleep(2500 * time.Millisecond) // the server's commit has failed by now
	c, err := s.RunTx(bg, p, fn)
	n := e.count(t, `SELECT count(*) FROM `+tbl+` WHERE key = 'k'`)
	t.Logf("retry with the same token: %v %v, %d effects", c.Outcome, err, n)
	if n > 1 {
		t.Errorf("the effect ran %d times (retry answered %v, %v)", n, c.Outcome, err)
	}
}

// TestTxidOnPlainPools: on pools that use the simple protocol or
// QueryExecModeExec, a well-behaved group succeeds in one transaction, and
// a member's COMMIT AND CHAIN is still seen by the transaction-id
// comparison (nothing doubled, the chainer held).
func TestTxidOnPlainPools(t *testing.T) {
	t.Parallel()
	onPlainPools(t, func(t *testing.T, plain func() (*env, string)) {
		pe, tbl := plain()
		ins := func(k string) func(context.Context, pgx.Tx) ([]byte, error) {
			return func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				_, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ($1, 1)`, k)
				return []byte(`1`), err
			}
		}
		errs := runQueued(t, pe, "ok", map[string]func(context.Context, pgx.Tx) ([]byte, error){
			"o0": ins("o0"), "o1": ins("o1"), "o2": ins("o2"),
		})
		for k, err := range errs {
			chainOutcome(t, pe, tbl, "ok", k, err)
		}
		// A store of its own: runQueued's blocker runs once per schema.
		pe2, tbl2 := plain()
		errs = runQueued(t, pe2, "ch", map[string]func(context.Context, pgx.Tx) ([]byte, error){
			"c0": func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				if _, err := tx.Exec(ctx, `INSERT INTO `+tbl2+` VALUES ('c0', 1)`); err != nil {
					return nil, err
				}
				_, err := tx.Conn().Exec(ctx, "COMMIT AND CHAIN")
				return nil, err
			},
			"c1": func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				_, err := tx.Exec(ctx, `INSERT INTO `+tbl2+` VALUES ('c1', 1)`)
				return nil, err
			},
		})
		for k, err := range errs {
			chainOutcome(t, pe2, tbl2, "ch", k, err)
		}
		if st := pe.store.BatchStats(); st.TxGroups < 1 {
			t.Fatalf("stats %+v", st)
		}
	})
}

// TestConnReadBeforeDeferKeepsDeferral: a deferring function that reads
// its transaction's connection harmlessly (its process id, for a log line)
// before Defer still has its statement deferred: only statements sent
// through the transaction make Defer refuse.
func TestConnReadBeforeDeferKeepsDeferral(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{GroupTx: 16, GroupFlushers: 1})
	tbl := e.effects(t)
	fns := map[string]func(context.Context, pgx.Tx) ([]byte, error){}
	for _, k := range []string{"a", "b", "c"} {
		ins := deferOrRun(`INSERT INTO `+tbl+` VALUES ($1, 1)`, k)
		fns[k] = func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			_ = tx.Conn().PgConn().PID()
			return ins(ctx, tx)
		}
	}
	errs := runQueued(t, e, "pid", fns)
	st := e.store.BatchStats()
	for k, err := range errs {
		if err != nil {
			t.Errorf("%s: %v", k, err)
		}
	}
	if st.TxGroups == 0 || st.TxDeferred == 0 {
		t.Errorf("stats %+v: no statement deferred", st)
	}
	if n := e.count(t, `SELECT count(*) FROM `+tbl); n != 3 {
		t.Errorf("%d effects, want 3", n)
	}
}
