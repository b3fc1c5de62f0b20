package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
)

// queuedInOrder is queued with the calls joining the group in the order
// given: each starts a moment after the one before.
func queuedInOrder(t *testing.T, e *env, calls []func()) {
	t.Helper()
	spaced := make([]func(), len(calls))
	for i, call := range calls {
		spaced[i] = func() {
			time.Sleep(time.Duration(i) * 30 * time.Millisecond)
			call()
		}
	}
	queued(t, e, spaced)
}

// chainOutcome checks what an operation of a run whose transaction a task
// committed part of (COMMIT AND CHAIN) left: completed with its effect
// once and no error; held (a person decides) with at most one effect; or
// no claim, no effect and an error. Anything else lost or doubled it.
func chainOutcome(t *testing.T, e *env, tbl, task, key string, err error) {
	t.Helper()
	n := e.count(t, `SELECT count(*) FROM `+tbl+` WHERE key = $1`, key)
	status := "none"
	if r, gerr := e.store.Get(context.Background(), task, key); gerr == nil {
		status = string(r.Status)
	}
	t.Logf("%s: %s, %d effects, err %v", key, status, n, err)
	switch {
	case status == "completed" && n == 1 && err == nil:
	case status == "held" && n <= 1 && err != nil:
	case (status == "none" || status == "failed") && n == 0 && err != nil:
	default:
		t.Errorf("%s: record %s with %d effects, err %v", key, status, n, err)
	}
}

// over is an env of another store over e's schema, on a pool of its own
// that set configures (nil: as it comes).
func (e *env) over(t *testing.T, set func(*pgxpool.Config), batch idempotency.BatchConfig) *env {
	t.Helper()
	return e.overURL(t, testenv.DatabaseURL(t), set, batch)
}

// overURL is over, the pool connecting to url.
func (e *env) overURL(t *testing.T, url string, set func(*pgxpool.Config), batch idempotency.BatchConfig) *env {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	if set != nil {
		set(cfg)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	s, err := idempotency.New(pool, idempotency.Config{Schema: e.schema, Batch: batch})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return &env{pool: pool, schema: e.schema, store: s}
}

// onPlainPools runs f, in parallel, for each plain query mode (no
// statement described: plainArrays); plain makes a store with transaction
// groups over a pool of that mode, with its effects table tbl.
func onPlainPools(t *testing.T, f func(t *testing.T, plain func() (pe *env, tbl string))) {
	t.Helper()
	for name, mode := range map[string]pgx.QueryExecMode{
		"simple": pgx.QueryExecModeSimpleProtocol, "exec": pgx.QueryExecModeExec,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			f(t, func() (*env, string) {
				e := newEnv(t, idempotency.BatchConfig{})
				return e.over(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.DefaultQueryExecMode = mode },
					idempotency.BatchConfig{GroupTx: 32, GroupFlushers: 1}), e.effects(t)
			})
		})
	}
}

// TestCommitAndChainInATransaction: a same-database task that commits its
// transaction itself and goes on in a new one (COMMIT AND CHAIN, against
// RunTx's contract) commits the claims and effects before it, also those
// of the members of its group before it. Whatever then makes the worker
// roll back and run the operations again (another member's failure, its
// own, a refused commit, a lost savepoint) must not run an effect that
// committed a second time, nor answer it as failed with no one told: each
// operation ends completed with its effect once, held, or without record
// and effect.
func TestCommitAndChainInATransaction(t *testing.T) {
	t.Parallel()
	type op struct {
		key string
		// fn runs the operation's effect (an insert of its key); first is
		// true on the first call for the key.
		fn func(ctx context.Context, tx pgx.Tx, first bool) error
	}
	insert := func(tbl string) func(ctx context.Context, tx pgx.Tx, key string) error {
		return func(ctx context.Context, tx pgx.Tx, key string) error {
			_, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ($1, 1)`, key)
			return err
		}
	}
	chain := func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Conn().Exec(ctx, "COMMIT AND CHAIN")
		return err
	}
	errTask := errors.New("task failed")
	type scenario struct {
		group    int  // GroupTx; 0: no groups
		mismatch bool // AllowMismatch: the group runs member by member
		ops      func(ins func(context.Context, pgx.Tx, string) error, refuse string) []op
	}
	plain := func(ins func(context.Context, pgx.Tx, string) error, key string) op {
		return op{key, func(ctx context.Context, tx pgx.Tx, _ bool) error { return ins(ctx, tx, key) }}
	}
	chainer := func(ins func(context.Context, pgx.Tx, string) error, key string, thenFail bool) op {
		return op{key, func(ctx context.Context, tx pgx.Tx, first bool) error {
			if err := ins(ctx, tx, key); err != nil || !first {
				return err
			}
			if err := chain(ctx, tx); err != nil {
				return err
			}
			if thenFail {
				return errTask
			}
			return nil
		}}
	}
	failer := func(ins func(context.Context, pgx.Tx, string) error, key string) op {
		return op{key, func(ctx context.Context, tx pgx.Tx, first bool) error {
			if first {
				return errTask
			}
			return ins(ctx, tx, key)
		}}
	}
	for name, sc := range map[string]scenario{
		"group, a later member fails": {group: 32, ops: func(ins func(context.Context, pgx.Tx, string) error, _ string) []op {
			return []op{plain(ins, "a0"), chainer(ins, "a1", false), failer(ins, "a2"), plain(ins, "a3")}
		}},
		"group, the chaining member fails": {group: 32, ops: func(ins func(context.Context, pgx.Tx, string) error, _ string) []op {
			return []op{plain(ins, "b0"), chainer(ins, "b1", true), plain(ins, "b2")}
		}},
		"group member by member": {group: 32, mismatch: true, ops: func(ins func(context.Context, pgx.Tx, string) error, _ string) []op {
			return []op{plain(ins, "c0"), chainer(ins, "c1", false), plain(ins, "c2")}
		}},
		"group commit refused": {group: 32, ops: func(ins func(context.Context, pgx.Tx, string) error, refuse string) []op {
			return []op{plain(ins, "d0"), chainer(ins, "d1", false), {"d2", func(ctx context.Context, tx pgx.Tx, first bool) error {
				if err := ins(ctx, tx, "d2"); err != nil || !first {
					return err
				}
				_, err := tx.Exec(ctx, refuse) // a deferred unique constraint: the commit is refused
				return err
			}}}
		}},
		"alone, then fails": {ops: func(ins func(context.Context, pgx.Tx, string) error, _ string) []op {
			return []op{chainer(ins, "e0", true)}
		}},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, idempotency.BatchConfig{GroupTx: sc.group, GroupFlushers: 1})
			tbl := e.effects(t)
			uniq := e.schema + ".uniq"
			if _, err := e.pool.Exec(context.Background(),
				`CREATE TABLE `+uniq+` (k int UNIQUE DEFERRABLE INITIALLY DEFERRED)`); err != nil {
				t.Fatal(err)
			}
			ops := sc.ops(insert(tbl), `INSERT INTO `+uniq+` VALUES (1), (1)`)
			errs := make([]error, len(ops))
			var calls []func()
			for i, o := range ops {
				var n atomic.Int32
				calls = append(calls, func() {
					p := params("chain", o.key)
					p.AllowMismatch = sc.mismatch
					_, errs[i] = e.store.RunTx(context.Background(), p, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
						return nil, o.fn(ctx, tx, n.Add(1) == 1)
					})
				})
			}
			if sc.group == 0 {
				var wg sync.WaitGroup
				for _, c := range calls {
					wg.Go(c)
				}
				wg.Wait()
			} else {
				queuedInOrder(t, e, calls)
				if st := e.store.BatchStats(); st.TxGroups == 0 {
					t.Fatalf("stats %+v: the calls did not run as a group", st)
				}
			}
			held := 0
			for i, o := range ops {
				chainOutcome(t, e, tbl, "chain", o.key, errs[i])
				if r, err := e.store.Get(context.Background(), "chain", o.key); err == nil && r.Status == idempotency.StatusHeld {
					held++
				}
			}
			if held == 0 {
				t.Error("no claim held: the task did not commit part of its transaction, or it went unnoticed")
			}
		})
	}
}

// TestEndedTasksDoNotExhaustThePool: tasks that end their transactions
// themselves, as many at once as the pool has connections, are completed
// (which takes a connection of the pool) without waiting for each other's:
// each gives its own back first.
func TestEndedTasksDoNotExhaustThePool(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{})
	tbl := e.effects(t)
	s := e.over(t, func(cfg *pgxpool.Config) { cfg.MaxConns = 2 },
		idempotency.BatchConfig{GroupTx: 1, Timeout: 20 * time.Second}).store
	const n = 6
	errs := make([]error, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			<-start
			key := fmt.Sprintf("k%d", i)
			_, errs[i] = s.RunTx(context.Background(), params("ender", key), func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				if _, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ($1, 1)`, key); err != nil {
					return nil, err
				}
				_, err := tx.Conn().Exec(ctx, "COMMIT")
				return nil, err
			})
		})
	}
	close(start)
	finished := make(chan struct{})
	go func() { wg.Wait(); close(finished) }()
	select {
	case <-finished:
	case <-time.After(10 * time.Second):
		<-finished
		t.Fatal("the tasks waited for the pool's connections, which they held, until the batch timeout")
	}
	for i, err := range errs {
		if err != nil {
			t.Errorf("k%d: %v", i, err)
		}
		if r := e.get(t, "ender", fmt.Sprintf("k%d", i)); r.Status != idempotency.StatusCompleted {
			t.Errorf("k%d: %s", i, r.Status)
		}
	}
}

// TestRolledBackRunAnswersAtItsDeadline: a well-behaved task whose
// statement runs into its caller's deadline because the database stopped
// answering (a network partition) gets its error at the deadline: the
// worker does not wait for the network to ask the record whether part of
// its transaction committed (its connection is gone; the next attempt's
// new token keeps such a claim from being taken for its own).
func TestRolledBackRunAnswersAtItsDeadline(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{})
	u, err := url.Parse(testenv.DatabaseURL(t))
	if err != nil {
		t.Fatal(err)
	}
	proxy := testenv.NewCutProxy(t, u.Host)
	var down atomic.Bool
	up := make(chan struct{})
	dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
		var d net.Dialer
		if down.Load() {
			// Unreachable: the dial hangs (no connect_timeout set).
			select {
			case <-up:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
			return d.DialContext(ctx, "tcp", u.Host)
		}
		return d.DialContext(ctx, "tcp", proxy.Addr())
	}
	s := e.over(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.DialFunc = dial },
		idempotency.BatchConfig{Disabled: true, GroupTx: 1}).store
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	done := make(chan error, 1)
	start := time.Now()
	go func() {
		_, err := s.RunTx(ctx, params("deadline", "k"), func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			proxy.Freeze() // the server goes silent
			down.Store(true)
			_, err := tx.Exec(ctx, "SELECT 1") // runs into the caller's deadline
			return nil, err
		})
		done <- err
	}()
	var once sync.Once
	restore := func() { once.Do(func() { close(up) }) }
	defer restore()
	select {
	case err := <-done:
		t.Logf("RunTx returned after %v: %v", time.Since(start).Round(time.Millisecond), err)
	case <-time.After(5 * time.Second):
		t.Errorf("RunTx has not returned %v after its context's 1 s deadline (network still down)",
			time.Since(start).Round(time.Millisecond))
		restore()
		err := <-done
		t.Logf("returned once the network came back, after %v: %v", time.Since(start).Round(time.Millisecond), err)
	}
}

// TestChainThenRollbackAndChain: a member commits part of the group's
// transaction (COMMIT AND CHAIN: every member's claim commits, the batch
// claimed them all first), the next, well-behaved, member writes its
// effect, and a third rolls back (ROLLBACK AND CHAIN). The claims are
// committed, so the completion would find them all: the group sees its
// transaction's id changed, and the well-behaved member is not answered
// success with its effect gone.
func TestChainThenRollbackAndChain(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{GroupTx: 32, GroupFlushers: 1})
	tbl := e.effects(t)
	ins := func(ctx context.Context, tx pgx.Tx, key string) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ($1, 1)`, key)
		return err
	}
	errs := runQueued(t, e, "rb", map[string]func(context.Context, pgx.Tx) ([]byte, error){
		"r0": func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			if err := ins(ctx, tx, "r0"); err != nil {
				return nil, err
			}
			_, err := tx.Conn().Exec(ctx, "COMMIT AND CHAIN")
			return nil, err
		},
		"r1": func(ctx context.Context, tx pgx.Tx) ([]byte, error) { return nil, ins(ctx, tx, "r1") },
		"r2": func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			if err := ins(ctx, tx, "r2"); err != nil {
				return nil, err
			}
			_, err := tx.Conn().Exec(ctx, "ROLLBACK AND CHAIN")
			return nil, err
		},
	})
	if st := e.store.BatchStats(); st.TxGroups == 0 {
		t.Fatalf("stats %+v: the calls did not run as a group", st)
	}
	chainOutcome(t, e, tbl, "rb", "r1", errs["r1"])
}

// TestChainCommitLandsLate: a member's COMMIT AND CHAIN is slow (a
// deferred constraint trigger here; a synchronous standby's wait, an fsync
// stall in production) and its caller's deadline cuts the connection
// first; the cancel request does not get through (the network trouble that
// made the commit slow). The group looks its claims up at once and finds
// none committed; the old transaction commits later. The member's next
// run claims with a new token: it finds that claim another's (in
// progress), never its own, and does not run the effect a second time;
// nor does a later delivery.
func TestChainCommitLandsLate(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{})
	tbl := e.effects(t)
	slow := e.schema + ".slow"
	ctx := context.Background()
	for _, q := range []string{
		`CREATE TABLE ` + slow + ` (k int)`,
		`CREATE FUNCTION ` + e.schema + `.slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(2); RETURN NULL; END $$`,
		`CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON ` + slow +
			` DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION ` + e.schema + `.slow_commit()`,
	} {
		if _, err := e.pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	var cut atomic.Bool
	pe := e.over(t, func(cfg *pgxpool.Config) {
		cfg.MaxConns = 10
		cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			if cut.Load() {
				return nil, errors.New("network unreachable")
			}
			var d net.Dialer
			return d.DialContext(ctx, network, addr)
		}
	}, idempotency.BatchConfig{GroupTx: 32, GroupFlushers: 1})
	pool, s := pe.pool, pe.store
	// Warm: idle connections for the group, made before the trouble.
	var conns []*pgxpool.Conn
	for range 8 {
		c, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	for _, c := range conns {
		c.Release()
	}
	var calls atomic.Int32
	errs := runQueued(t, pe, "late", map[string]func(context.Context, pgx.Tx) ([]byte, error){
		"x0": func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			if _, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ('x0', 1)`); err != nil {
				return nil, err
			}
			if calls.Add(1) > 1 {
				return nil, nil
			}
			if _, err := tx.Exec(ctx, `INSERT INTO `+slow+` VALUES (1)`); err != nil {
				return nil, err
			}
			cut.Store(true)
			time.AfterFunc(time.Second, func() { cut.Store(false) })
			sctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
			defer cancel()
			_, err := tx.Conn().Exec(sctx, "COMMIT AND CHAIN")
			return nil, err
		},
		"x1": func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			_, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ('x1', 1)`)
			return nil, err
		},
	})
	if st := s.BatchStats(); st.TxGroups == 0 {
		t.Fatalf("stats %+v: the calls did not run as a group", st)
	}
	time.Sleep(2 * time.Second) // the old transaction has ended either way
	n := e.count(t, `SELECT count(*) FROM `+tbl+` WHERE key = 'x0'`)
	r := e.get(t, "late", "x0")
	t.Logf("x0: %s, %d effects, err %v", r.Status, n, errs["x0"])
	switch {
	case r.Status == idempotency.StatusCompleted && n == 1 && errs["x0"] == nil:
	case (r.Status == idempotency.StatusClaimed || r.Status == idempotency.StatusHeld) && n <= 1:
		// Answered in progress, or failed: the delivery is kept, or its
		// next one finds the claim another's.
		c, err := s.RunTx(ctx, params("late", "x0"), func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			_, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ('x0', 1)`)
			return nil, err
		})
		if err != nil || c.Outcome == idempotency.OutcomeFirst {
			t.Errorf("a later delivery of x0: %v, %v", c.Outcome, err)
		}
	default:
		t.Errorf("x0: record %s with %d effects, err %v", r.Status, n, errs["x0"])
	}
	if n := e.count(t, `SELECT count(*) FROM `+tbl+` WHERE key = 'x0'`); n > 1 {
		t.Errorf("x0: %d effects", n)
	}
}

// TestChainedLookupOnPlainPools: the record lookup after a rollback works
// on pools that send arguments without describing statements
// (plainArrays), with keys that need quoting in an array literal.
func TestChainedLookupOnPlainPools(t *testing.T) {
	t.Parallel()
	onPlainPools(t, func(t *testing.T, plain func() (*env, string)) {
		pe, tbl := plain()
		s := pe.store
		keys := []string{`a,"b"\{}`, "NULL", ` sp `, "é'"}
		fns := map[string]func(context.Context, pgx.Tx) ([]byte, error){}
		for i, k := range keys {
			fns[k] = func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				if _, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ($1, 1)`, k); err != nil {
					return nil, err
				}
				if i == 1 {
					if _, err := tx.Conn().Exec(ctx, "COMMIT AND CHAIN"); err != nil {
						return nil, err
					}
					return nil, errors.New("fails after committing")
				}
				return nil, nil
			}
		}
		errs := runQueued(t, pe, "plain", fns)
		held := 0
		for _, k := range keys {
			chainOutcome(t, pe, tbl, "plain", k, errs[k])
			if r, err := s.Get(context.Background(), "plain", k); err == nil && r.Status == idempotency.StatusHeld {
				held++
			}
		}
		if held == 0 {
			t.Error("nothing held")
		}
	})
}
