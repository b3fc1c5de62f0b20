package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceler/onceler/idempotency"
)

// creditFn is a RunTx function whose effect is one statement: it adds a
// cent to the one row of tbl's account and returns "key:balance". It
// defers the statement when its group takes it, and runs it itself
// otherwise, as Defer says. ran counts the calls that ran it themselves.
func creditFn(tbl, key string, ran *sync.Map) func(context.Context, pgx.Tx) ([]byte, error) {
	sql := `INSERT INTO ` + tbl + ` AS b (account, cents, last) VALUES ('acct', 1, $1)
ON CONFLICT (account) DO UPDATE SET cents = b.cents + 1, last = $1 RETURNING $1 || ':' || b.cents`
	read := func(row pgx.Row) ([]byte, error) {
		var s string
		if err := row.Scan(&s); err != nil {
			return nil, err
		}
		return []byte(`"` + s + `"`), nil
	}
	return func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		if idempotency.Defer(ctx, idempotency.Deferred{SQL: sql, Args: []any{key}, Row: read}) {
			return nil, nil
		}
		if ran != nil {
			ran.Store(key, true)
		}
		return read(tx.QueryRow(ctx, sql, key))
	}
}

func (e *env) balances(t *testing.T) string {
	t.Helper()
	tbl := e.schema + ".balances"
	if _, err := e.pool.Exec(context.Background(),
		`CREATE TABLE IF NOT EXISTS `+tbl+` (account text PRIMARY KEY, cents int NOT NULL, last text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	return tbl
}

// TestDeferredStatementsOfAGroup runs same-database operations whose effect
// is one statement each, all on one row, through transaction groups (fixed
// and adaptive): the groups run the statements they deferred, each
// operation's result is its own statement's row (its key, and a balance
// no other has), every effect lands once, and the record completes each.
func TestDeferredStatementsOfAGroup(t *testing.T) {
	t.Parallel()
	for _, group := range []int{16, 0} {
		t.Run(fmt.Sprintf("group%d", group), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, idempotency.BatchConfig{GroupTx: group})
			tbl := e.balances(t)
			ctx := context.Background()
			const n = 300
			claims := make([]idempotency.Claim, n)
			errs := make([]error, n)
			var wg sync.WaitGroup
			for i := range n {
				wg.Go(func() {
					key := fmt.Sprintf("op%d", i)
					claims[i], errs[i] = e.store.RunTx(ctx, params("credit", key), creditFn(tbl, key, nil))
				})
			}
			wg.Wait()
			seen := map[string]bool{}
			for i := range n {
				key := fmt.Sprintf("op%d", i)
				if errs[i] != nil || claims[i].Outcome != idempotency.OutcomeFirst || claims[i].Status != idempotency.StatusCompleted {
					t.Fatalf("%s: %+v %v", key, claims[i], errs[i])
				}
				res := strings.Trim(string(claims[i].Result), `"`)
				k, bal, _ := strings.Cut(res, ":")
				if k != key || seen[bal] {
					t.Fatalf("%s: result %s: another's row, or a balance twice", key, claims[i].Result)
				}
				seen[bal] = true
				if r := e.get(t, "credit", key); string(r.Result) != string(claims[i].Result) {
					t.Fatalf("%s: record's result %s, the caller's %s", key, r.Result, claims[i].Result)
				}
			}
			if got := e.count(t, `SELECT cents FROM `+tbl); got != n {
				t.Fatalf("balance %d, want %d", got, n)
			}
			st := e.store.BatchStats()
			if st.TxDeferred == 0 || st.TxGroups == 0 {
				t.Fatalf("stats %+v: no statement ran deferred", st)
			}
			t.Logf("%+v", st)
		})
	}
}

// TestDeferredStatementFailsAlone: a deferred statement that fails (a
// unique violation) fails its own operation only, as in a transaction of
// its own; the others of its group commit theirs once, and a repeat of a
// committed one is answered from the record without running again.
func TestDeferredStatementFailsAlone(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{GroupTx: 16, GroupFlushers: 1})
	tbl := e.schema + ".entries"
	ctx := context.Background()
	if _, err := e.pool.Exec(ctx, `CREATE TABLE `+tbl+` (entry text PRIMARY KEY); INSERT INTO `+tbl+` VALUES ('taken')`); err != nil {
		t.Fatal(err)
	}
	insert := func(entry string) func(context.Context, pgx.Tx) ([]byte, error) {
		sql := `INSERT INTO ` + tbl + ` VALUES ($1)`
		return func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			if idempotency.Defer(ctx, idempotency.Deferred{SQL: sql, Args: []any{entry}}) {
				return []byte(`"deferred"`), nil
			}
			if _, err := tx.Exec(ctx, sql, entry); err != nil {
				return nil, err
			}
			return []byte(`"ran"`), nil
		}
	}
	const n = 64
	errs := make([]error, n)
	claims := make([]idempotency.Claim, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			entry := fmt.Sprintf("e%d", i)
			if i == n/2 {
				entry = "taken"
			}
			claims[i], errs[i] = e.store.RunTx(ctx, params("entry", fmt.Sprintf("op%d", i)), insert(entry))
		})
	}
	wg.Wait()
	for i := range n {
		if i == n/2 {
			var pgErr *pgconn.PgError
			if !errors.As(errs[i], &pgErr) || pgErr.Code != "23505" {
				t.Fatalf("op%d: %v, want the unique violation", i, errs[i])
			}
			continue
		}
		if errs[i] != nil || claims[i].Status != idempotency.StatusCompleted {
			t.Fatalf("op%d: %+v %v", i, claims[i], errs[i])
		}
	}
	if got := e.count(t, `SELECT count(*) FROM `+tbl); got != n {
		t.Fatalf("%d entries, want %d (n-1 and the one taken before)", got, n)
	}
	if got := e.count(t, `SELECT count(*) FROM `+e.schema+`.records WHERE key = $1`, fmt.Sprintf("op%d", n/2)); got != 0 {
		t.Fatalf("the failed operation left %d records", got)
	}
	c, err := e.store.RunTx(ctx, params("entry", "op1"), insert("e1"))
	if err != nil || c.Outcome != idempotency.OutcomeCompleted {
		t.Fatalf("repeat: %+v %v", c, err)
	}
}

// TestDeferTwiceRunsMemberByMember: a function that defers a second
// statement is told no; its group then runs member by member, where
// nothing is deferred, and each function's two statements run once, in
// its order.
func TestDeferTwiceRunsMemberByMember(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{GroupTx: 16, GroupFlushers: 1})
	tbl := e.schema + ".steps"
	ctx := context.Background()
	if _, err := e.pool.Exec(ctx, `CREATE TABLE `+tbl+` (key text, step int, at bigserial)`); err != nil {
		t.Fatal(err)
	}
	const n = 32
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			key := fmt.Sprintf("op%d", i)
			_, errs[i] = e.store.RunTx(ctx, params("steps", key), func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				for step := 1; step <= 2; step++ {
					d := idempotency.Deferred{SQL: `INSERT INTO ` + tbl + ` (key, step) VALUES ($1, $2)`, Args: []any{key, step}}
					if i%2 == 0 && idempotency.Defer(ctx, d) {
						continue
					}
					if _, err := tx.Exec(ctx, d.SQL, d.Args...); err != nil {
						return nil, err
					}
				}
				return nil, nil
			})
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("op%d: %v", i, err)
		}
	}
	if got := e.count(t, `SELECT count(*) FROM `+tbl); got != 2*n {
		t.Fatalf("%d steps, want %d", got, 2*n)
	}
	if got := e.count(t, `SELECT count(*) FROM (SELECT key FROM `+tbl+` GROUP BY key
		HAVING count(*) <> 2 OR min(at) FILTER (WHERE step = 1) > min(at) FILTER (WHERE step = 2)) x`); got != 0 {
		t.Fatalf("%d operations whose steps did not run once each, in order", got)
	}
}

// queued runs calls (each its own goroutine) while a first RunTx holds the
// group's one flusher, so that they queue up and go in one group once it
// returns: fixed groups of up to 32, one flusher.
func queued(t *testing.T, e *env, calls []func()) {
	t.Helper()
	started, release := make(chan struct{}), make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		_, err := e.store.RunTx(context.Background(), params("blocker", "blocker"), func(context.Context, pgx.Tx) ([]byte, error) {
			close(started)
			<-release
			return nil, nil
		})
		if err != nil {
			t.Error(err)
		}
	})
	<-started
	for _, call := range calls {
		wg.Go(call)
	}
	time.Sleep(300 * time.Millisecond)
	close(release)
	wg.Wait()
}

// TestDeferredThenEndedByAnother: a group member that commits the
// transaction itself ends it before the statements deferred by the members
// before it have run: those run again in transactions of their own, and
// every effect lands once.
func TestDeferredThenEndedByAnother(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{GroupTx: 32, GroupFlushers: 1})
	tbl := e.balances(t)
	effects := e.effects(t)
	ctx := context.Background()
	const n = 20
	errs := make([]error, n)
	var ran sync.Map
	calls := make([]func(), n)
	for i := range n {
		calls[i] = func() {
			key := fmt.Sprintf("op%02d", i)
			fn := creditFn(tbl, key, &ran)
			if i == n-1 {
				// The last of its group: the others have deferred.
				fn = func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
					if _, err := tx.Exec(ctx, `INSERT INTO `+effects+` VALUES ('ender', 1)`); err != nil {
						return nil, err
					}
					if _, err := tx.Conn().Exec(ctx, "COMMIT"); err != nil {
						return nil, err
					}
					return []byte(`"ended"`), nil
				}
			}
			_, errs[i] = e.store.RunTx(ctx, params("credit", key), fn)
		}
	}
	queued(t, e, calls)
	for i, err := range errs {
		if err != nil {
			t.Fatalf("op%02d: %v", i, err)
		}
	}
	reran := 0
	ran.Range(func(any, any) bool { reran++; return true })
	if reran != n-1 {
		t.Fatalf("%d deferring members ran again on their own, want %d: the group did not end with their statements waiting", reran, n-1)
	}
	if got := e.count(t, `SELECT cents FROM `+tbl); got != n-1 {
		t.Fatalf("balance %d, want %d: an effect lost or doubled", got, n-1)
	}
	if got := e.count(t, `SELECT count(*) FROM `+effects); got != 1 {
		t.Fatalf("%d effects of the member that ended the transaction", got)
	}
	if got := e.count(t, `SELECT count(*) FROM `+e.schema+`.records WHERE task = 'credit' AND status = 'completed'`); got != n {
		t.Fatalf("%d completed records, want %d", got, n)
	}
}

func TestDeferrable(t *testing.T) {
	t.Parallel()
	for sql, want := range map[string]bool{
		"INSERT INTO t VALUES (1)":                   true,
		"  with x AS (SELECT 1) UPDATE t SET a = 1":  true,
		"-- note\nselect 1":                          true,
		"/* a /* nested */ comment */ DELETE FROM t": true,
		"values (1)": true,
		"MERGE INTO t USING s ON true WHEN MATCHED THEN DO NOTHING": true,
		"TABLE t":                    true,
		"COMMIT":                     false,
		"  rollback":                 false,
		"/* */ BEGIN":                false,
		"CALL p()":                   false,
		"DO $$ BEGIN END $$":         false,
		"SAVEPOINT s":                false,
		"-- only a comment":          false,
		"-- a\rCOMMIT /*\nSELECT */": false,
		"-- a\rSELECT 1":             true,
		"/* unterminated SELECT":     false,
		"SELECTX 1":                  false,
		"select_end":                 false,
		"SELECT$1":                   false,
		"":                           false,
		"SET LOCAL lock_timeout = 1": false,
	} {
		if got := idempotency.Deferrable(sql); got != want {
			t.Errorf("deferrable(%q) = %v, want %v", sql, got, want)
		}
	}
}

// rewriteTo is a query rewriter that makes any statement another one.
type rewriteTo string

func (r rewriteTo) RewriteQuery(context.Context, *pgx.Conn, string, []any) (string, []any, error) {
	return string(r), nil, nil
}

func TestDeferredArguments(t *testing.T) {
	t.Parallel()
	for name, c := range map[string]struct {
		args []any
		want bool
	}{
		"none":           {nil, true},
		"values":         {[]any{1, "a"}, true},
		"named":          {[]any{pgx.NamedArgs{"a": 1}}, true},
		"strict named":   {[]any{pgx.StrictNamedArgs{"a": 1}}, true},
		"rewriter":       {[]any{rewriteTo("COMMIT")}, false},
		"exec mode":      {[]any{pgx.QueryExecModeSimpleProtocol, 1}, false},
		"result formats": {[]any{pgx.QueryResultFormats{pgx.TextFormatCode}}, false},
	} {
		if got := idempotency.PlainArgs(c.args); got != c.want {
			t.Errorf("%s: %v, want %v", name, got, c.want)
		}
	}
}

// runQueued runs fns (key -> function) as the calls of one group (queued)
// and returns their errors.
func runQueued(t *testing.T, e *env, task string, fns map[string]func(context.Context, pgx.Tx) ([]byte, error)) map[string]error {
	t.Helper()
	errs := map[string]error{}
	var mu sync.Mutex
	var calls []func()
	for k, fn := range fns {
		calls = append(calls, func() {
			_, err := e.store.RunTx(context.Background(), params(task, k), fn)
			mu.Lock()
			errs[k] = err
			mu.Unlock()
		})
	}
	queued(t, e, calls)
	return errs
}

// deferOrRun defers sql, or runs it on tx when the group does not take it.
func deferOrRun(sql string, args ...any) func(context.Context, pgx.Tx) ([]byte, error) {
	return func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		if idempotency.Defer(ctx, idempotency.Deferred{SQL: sql, Args: args}) {
			return nil, nil
		}
		_, err := tx.Exec(ctx, sql, args...)
		return nil, err
	}
}

// TestDeferredStatementEndsTheGroup: a deferred statement that ends or
// changes the group's transaction, which Defer's check of the text keeps
// out (here it is let in), commits nothing after it and doubles nothing:
// every other operation is completed with its effect once, held, or left
// without a record and without its effect; one whose claim did not commit
// runs again on its own and completes.
func TestDeferredStatementEndsTheGroup(t *testing.T) {
	t.Parallel()
	for _, end := range []string{"COMMIT", "ROLLBACK", "COMMIT AND CHAIN", "ROLLBACK AND CHAIN",
		"ROLLBACK TO SAVEPOINT onceler_deferred", "RELEASE SAVEPOINT onceler_deferred"} {
		t.Run(end, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, idempotency.BatchConfig{GroupTx: 32, GroupFlushers: 1})
			tbl := e.effects(t)
			ins := `INSERT INTO ` + tbl + ` VALUES ($1, 1)`
			var calls sync.Map
			fns := map[string]func(context.Context, pgx.Tx) ([]byte, error){
				"op0": deferOrRun(ins, "op0"),
				"op1": func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
					if _, again := calls.LoadOrStore("op1", true); !again && idempotency.DeferUnchecked(ctx, idempotency.Deferred{SQL: end}) {
						return nil, nil
					}
					return nil, nil // on its own: no statement
				},
				"op2": deferOrRun(ins, "op2"),
				"op3": func(ctx context.Context, tx pgx.Tx) ([]byte, error) { // runs itself, before the batch
					_, err := tx.Exec(ctx, ins, "op3")
					return nil, err
				},
			}
			errs := runQueued(t, e, "end", fns)
			if st := e.store.BatchStats(); st.TxGroups == 0 {
				t.Fatalf("stats %+v: the calls did not run as a group", st)
			}
			for _, k := range []string{"op0", "op2", "op3"} {
				n := e.count(t, `SELECT count(*) FROM `+tbl+` WHERE key = $1`, k)
				status := "none"
				if r, err := e.store.Get(context.Background(), "end", k); err == nil {
					status = string(r.Status)
				}
				ok := status == "completed" && n == 1 && errs[k] == nil || status == "held" && n <= 1 || status == "none" && n == 0 && errs[k] != nil
				t.Logf("%s: %s, %d effects, err %v", k, status, n, errs[k])
				if !ok {
					t.Errorf("%s: record %s with %d effects, err %v", k, status, n, errs[k])
				}
			}
		})
	}
}

func TestTxControlTags(t *testing.T) {
	t.Parallel()
	for tag, want := range map[string]bool{
		"INSERT 0 1": false, "UPDATE 3": false, "DELETE 0": false, "SELECT 1": false, "MERGE 2": false,
		"COMMIT": true, "ROLLBACK": true, "SAVEPOINT": true, "RELEASE": true, "BEGIN": true,
		"START TRANSACTION": true, "PREPARE TRANSACTION": true, "SET": true,
	} {
		if got := idempotency.TxControl(pgconn.NewCommandTag(tag)); got != want {
			t.Errorf("txControl(%q) = %v, want %v", tag, got, want)
		}
	}
}

// TestDeferThenEndTheTransaction: a function that defers its statement and
// then commits the transaction itself (against Defer's contract) does not
// complete its operation without the statement, nor run again what it
// may have written before: it is held. The others run again on their own.
func TestDeferThenEndTheTransaction(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{GroupTx: 32, GroupFlushers: 1})
	tbl := e.effects(t)
	ins := `INSERT INTO ` + tbl + ` VALUES ($1, 1)`
	errs := runQueued(t, e, "dc", map[string]func(context.Context, pgx.Tx) ([]byte, error){
		"b0": deferOrRun(ins, "b0"),
		"b1": func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			if !idempotency.Defer(ctx, idempotency.Deferred{SQL: ins, Args: []any{"b1"}}) {
				if _, err := tx.Exec(ctx, ins, "b1"); err != nil {
					return nil, err
				}
			}
			_, err := tx.Exec(ctx, "COMMIT")
			return []byte(`"b1"`), err
		},
		"b2": deferOrRun(ins, "b2"),
	})
	for _, k := range []string{"b0", "b2"} {
		n := e.count(t, `SELECT count(*) FROM `+tbl+` WHERE key = $1`, k)
		if r := e.get(t, "dc", k); r.Status != idempotency.StatusCompleted || n != 1 || errs[k] != nil {
			t.Errorf("%s: record %s, %d effects, err %v", k, r.Status, n, errs[k])
		}
	}
	if r := e.get(t, "dc", "b1"); r.Status != idempotency.StatusHeld || errs["b1"] == nil {
		t.Errorf("b1: record %s, err %v", r.Status, errs["b1"])
	}
}

// TestNestedRunTxDoesNotDefer: a group member's function that runs an
// operation of its own through another store's RunTx, with its context,
// gets that operation's statement run there, not deferred to the outer
// member's group, where it would be lost with the outer attempt.
func TestNestedRunTxDoesNotDefer(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{GroupTx: 32, GroupFlushers: 1})
	tbl := e.effects(t)
	inner, err := idempotency.New(e.pool, idempotency.Config{Schema: e.schema, Batch: idempotency.BatchConfig{GroupTx: 1}})
	if err != nil {
		t.Fatal(err)
	}
	defer inner.Close()
	ins := `INSERT INTO ` + tbl + ` VALUES ($1, 1)`
	errs := runQueued(t, e, "nest", map[string]func(context.Context, pgx.Tx) ([]byte, error){
		"c0": func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			_, err := inner.RunTx(ctx, params("inner", "k"), deferOrRun(ins, "inner"))
			return []byte(`"outer"`), err
		},
		"c1": deferOrRun(ins, "c1"),
		"c2": func(context.Context, pgx.Tx) ([]byte, error) {
			return nil, errors.New("fails: the group runs member by member")
		},
	})
	if errs["c0"] != nil {
		t.Fatal(errs["c0"])
	}
	r := e.get(t, "inner", "k")
	if n := e.count(t, `SELECT count(*) FROM `+tbl+` WHERE key = 'inner'`); r.Status != idempotency.StatusCompleted || n != 1 {
		t.Fatalf("inner operation %s with %d effects", r.Status, n)
	}
}
