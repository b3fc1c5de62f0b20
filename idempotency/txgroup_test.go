package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/idempotency"
)

// TestRunTxGroup runs many same-database tasks at once through transaction
// groups: every effect lands once, a task whose function fails leaves no
// record and no effect while the others of its group commit, a repeat is
// answered from the record, and the groups commit far fewer transactions
// than tasks.
func TestRunTxGroup(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{GroupTx: 16, GroupFlushers: 2})
	tbl := e.effects(t)
	ctx := context.Background()
	errBoom := errors.New("boom")
	const n = 200
	run := func(key string, fail bool) func(context.Context, pgx.Tx) ([]byte, error) {
		return func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			if _, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ($1, 1)`, key); err != nil {
				return nil, err
			}
			if fail {
				return nil, errBoom
			}
			return []byte(`{"key":"` + key + `"}`), nil
		}
	}
	var commits0 int64
	if err := e.pool.QueryRow(ctx, `SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()`).Scan(&commits0); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make([]error, n)
	claims := make([]idempotency.Claim, n)
	for i := range n {
		wg.Go(func() {
			key := fmt.Sprintf("op%d", i)
			claims[i], errs[i] = e.store.RunTx(ctx, params("credit", key), run(key, i%10 == 9))
		})
	}
	wg.Wait()
	for i := range n {
		if i%10 == 9 {
			if !errors.Is(errs[i], errBoom) {
				t.Fatalf("task %d: err %v, want the function's error", i, errs[i])
			}
			continue
		}
		if errs[i] != nil || claims[i].Outcome != idempotency.OutcomeFirst || claims[i].Status != idempotency.StatusCompleted {
			t.Fatalf("task %d: %+v %v", i, claims[i], errs[i])
		}
	}
	if got := e.count(t, `SELECT count(*) FROM `+tbl); got != n-n/10 {
		t.Fatalf("%d effects, want %d", got, n-n/10)
	}
	if got := e.count(t, `SELECT count(*) FROM `+e.schema+`.records WHERE status = 'completed'`); got != n-n/10 {
		t.Fatalf("%d completed records, want %d", got, n-n/10)
	}
	if got := e.count(t, `SELECT count(*) FROM `+e.schema+`.records WHERE key = 'op9'`); got != 0 {
		t.Fatalf("the failed task left %d records", got)
	}

	// Repeats, concurrently with a retry of a failed one.
	for i := range n {
		wg.Go(func() {
			key := fmt.Sprintf("op%d", i)
			claims[i], errs[i] = e.store.RunTx(ctx, params("credit", key), run(key, false))
		})
	}
	wg.Wait()
	for i := range n {
		want := idempotency.OutcomeCompleted
		if i%10 == 9 {
			want = idempotency.OutcomeFirst
		}
		if errs[i] != nil || claims[i].Outcome != want {
			t.Fatalf("repeat %d: %+v %v, want %v", i, claims[i], errs[i], want)
		}
	}
	if got := e.count(t, `SELECT count(*) FROM `+tbl); got != n {
		t.Fatalf("%d effects after the repeats, want %d", got, n)
	}
	if got := e.count(t, `SELECT coalesce(sum(duplicate_count), 0) FROM `+e.schema+`.records`); got != n-n/10 {
		t.Fatalf("%d duplicates counted, want %d", got, n-n/10)
	}
	var commits1 int64
	if _, err := e.pool.Exec(ctx, `SELECT pg_stat_force_next_flush()`); err != nil {
		t.Fatal(err)
	}
	if err := e.pool.QueryRow(ctx, `SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()`).Scan(&commits1); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d commits in the database for %d tasks (other sessions count too)", commits1-commits0, 2*n)
}

// TestRunTxGroupCancelled: a call whose context is cancelled before its
// group runs it is never written.
func TestRunTxGroupCancelled(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{GroupTx: 8, GroupFlushers: 1})
	tbl := e.effects(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := e.store.RunTx(ctx, params("credit", "gone"), func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		_, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ('gone', 1)`)
		return nil, err
	})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err %v, want context.Canceled", err)
	}
	if got := e.count(t, `SELECT count(*) FROM `+e.schema+`.records`); got != 0 {
		t.Fatalf("%d records written", got)
	}
}

// TestRunTxGroupAbortedByAMember: a member's function that catches its
// statement's error and returns leaves the group's transaction failed. As in
// a transaction of its own, that member fails; the others of its group
// commit and are answered as their own (not fenced).
func TestRunTxGroupAbortedByAMember(t *testing.T) {
	for _, write := range []bool{false, true} {
		t.Run(fmt.Sprintf("effects=%v", write), func(t *testing.T) {
			e := newEnv(t, idempotency.BatchConfig{GroupTx: 8, GroupFlushers: 1})
			tbl := e.effects(t)
			ctx := context.Background()
			release := make(chan struct{})
			var wg sync.WaitGroup
			// A blocker holds the only group flusher, so that the next four
			// queue into one group.
			wg.Go(func() {
				if _, err := e.store.RunTx(ctx, params("credit", "0"), func(context.Context, pgx.Tx) ([]byte, error) {
					<-release
					return []byte(`0`), nil
				}); err != nil {
					t.Errorf("blocker: %v", err)
				}
			})
			time.Sleep(100 * time.Millisecond)
			keys := []string{"a", "b", "c", "d"}
			errs := make([]error, len(keys))
			claims := make([]idempotency.Claim, len(keys))
			for i, k := range keys {
				wg.Go(func() {
					claims[i], errs[i] = e.store.RunTx(ctx, params("credit", k), func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
						if write {
							if _, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ($1, 1)`, k); err != nil {
								return nil, err
							}
						}
						if k == "b" {
							var x int
							_ = tx.QueryRow(ctx, `SELECT 1/0`).Scan(&x) // the error is swallowed
						}
						return []byte(`1`), nil
					})
				})
			}
			time.Sleep(200 * time.Millisecond)
			close(release)
			wg.Wait()
			for i, k := range keys {
				switch {
				case k == "b" && errs[i] == nil:
					t.Errorf("member b, whose transaction failed, succeeded: %+v", claims[i])
				case k != "b" && (errs[i] != nil || claims[i].Outcome != idempotency.OutcomeFirst):
					t.Errorf("member %s: %+v %v, want its own success", k, claims[i], errs[i])
				}
			}
			want := 0
			if write {
				want = 3
			}
			if n := e.count(t, `SELECT count(*) FROM `+tbl); n != want {
				t.Errorf("%d effects committed, want %d (a, c, d)", n, want)
			}
		})
	}
}

// TestRunTxAdaptiveGroups: with the default (adaptive) groups a lone call
// commits in a transaction of its own at once; a burst of short calls
// shares transactions, a failing member rolled back alone; slow functions
// run in parallel, in transactions of their own.
func TestRunTxAdaptiveGroups(t *testing.T) {
	e := newEnv(t, idempotency.BatchConfig{})
	ctx := context.Background()
	tbl := e.schema + ".adaptive"
	// txid_current() is the top transaction's id, savepoints or not.
	if _, err := e.pool.Exec(ctx, `CREATE TABLE `+tbl+` (key text NOT NULL, amount int NOT NULL, xid bigint NOT NULL DEFAULT txid_current())`); err != nil {
		t.Fatal(err)
	}
	errBoom := errors.New("boom")
	insert := func(key string, fail bool, sleep time.Duration) func(context.Context, pgx.Tx) ([]byte, error) {
		return func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			time.Sleep(sleep)
			if _, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ($1, 1)`, key); err != nil {
				return nil, err
			}
			if fail {
				return nil, errBoom
			}
			return []byte(`1`), nil
		}
	}
	xmins := func(prefix string) int {
		return e.count(t, `SELECT count(DISTINCT xid) FROM `+tbl+` WHERE key LIKE $1`, prefix+"%")
	}

	t0 := time.Now()
	if c, err := e.store.RunTx(ctx, params("credit", "lone"), insert("lone", false, 0)); err != nil || c.Outcome != idempotency.OutcomeFirst {
		t.Fatalf("lone call: %+v %v", c, err)
	}
	if took := time.Since(t0); took > time.Second {
		t.Errorf("a lone call took %v", took)
	}

	const n = 300
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			key := fmt.Sprintf("burst%03d", i)
			_, errs[i] = e.store.RunTx(ctx, params("credit", key), insert(key, i%50 == 7, 0))
		})
	}
	wg.Wait()
	for i, err := range errs {
		if (i%50 == 7) != errors.Is(err, errBoom) || (i%50 != 7 && err != nil) {
			t.Fatalf("burst call %d: %v", i, err)
		}
	}
	if got := e.count(t, `SELECT count(*) FROM `+tbl+` WHERE key LIKE 'burst%'`); got != n-n/50 {
		t.Fatalf("%d burst effects, want %d", got, n-n/50)
	}
	if txs := xmins("burst"); txs > n/4 {
		t.Errorf("%d burst calls committed in %d transactions: not grouped", n, txs)
	} else {
		t.Logf("%d burst calls committed in %d transactions", n, txs)
	}

	// Slow functions: once measured slow, calls run alone, in parallel
	// (the first round teaches the estimate).
	const slow = 8
	for round := range 2 {
		t0 = time.Now()
		for i := range slow {
			wg.Go(func() {
				key := fmt.Sprintf("slow%d-%d", round, i)
				if _, err := e.store.RunTx(ctx, params("credit", key), insert(key, false, 100*time.Millisecond)); err != nil {
					t.Errorf("slow call: %v", err)
				}
			})
		}
		wg.Wait()
		if took := time.Since(t0); round > 0 && took > 500*time.Millisecond {
			t.Errorf("round %d: %d slow calls of 100 ms took %v: run one after another", round, slow, took)
		}
	}
	if txs := xmins("slow1-"); txs != slow {
		t.Errorf("%d slow calls committed in %d transactions, want one each", slow, txs)
	}
}

// TestAdaptiveGroupsNeverQueueSlowFunctions runs slow same-database
// functions through adaptive groups on a fresh store, and again once the
// estimate of their duration has gone stale: each time they run side by
// side. A group that took several of them before it knew them slow would
// run them one after another on its connection, each waiting for the
// previous.
func TestAdaptiveGroupsNeverQueueSlowFunctions(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{})
	ctx := context.Background()
	const n, d = 4, time.Second
	slow := func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		if _, err := tx.Exec(ctx, `SELECT pg_sleep($1)`, d.Seconds()); err != nil {
			return nil, err
		}
		return []byte(`{}`), nil
	}
	round := func(name string) {
		t.Helper()
		var wg sync.WaitGroup
		errs := make([]error, n)
		t0 := time.Now()
		// The first runs alone, the second goes to a group, the last two
		// come once it has run for longer than a group's function should.
		for i, at := range []time.Duration{0, 50 * time.Millisecond, 300 * time.Millisecond, 300 * time.Millisecond} {
			wg.Go(func() {
				time.Sleep(at)
				_, errs[i] = e.store.RunTx(ctx, params("sleep", fmt.Sprintf("%s-%d", name, i)), slow)
			})
		}
		wg.Wait()
		took := time.Since(t0)
		for i, err := range errs {
			if err != nil {
				t.Fatalf("%s: call %d: %v", name, i, err)
			}
		}
		// Side by side: about d and the last start. One waiting for
		// another: 2d at least.
		if took >= 2*d-100*time.Millisecond {
			t.Fatalf("%s: %d calls of %v took %v: some waited for others", name, n, d, took)
		}
		t.Logf("%s: %d calls of %v took %v", name, n, d, took.Round(time.Millisecond))
	}
	round("fresh")
	time.Sleep(1500 * time.Millisecond) // the estimate goes stale
	round("stale")
	round("known")
}

// TestAdaptiveGroupOverlapsCommit: an adaptive group gives up its turn
// once its functions have run, before it completes and commits, so the next group runs its functions while the last one's
// commit is under way (here a commit made slow by a deferred constraint
// trigger), and every call commits once.
func TestAdaptiveGroupOverlapsCommit(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{})
	ctx := context.Background()
	ran, commits := e.schema+".ran", e.schema+".commits"
	const sleep = 300 * time.Millisecond
	// The trigger runs at each transaction's commit and, in a group (a
	// transaction of several functions), sleeps once and notes when its
	// sleep began. Transactions of one function commit at once: a wave
	// that the scheduler splits into lone calls and probes does not hold
	// every flusher in a slow commit.
	for _, q := range []string{
		`CREATE TABLE ` + ran + ` (key text PRIMARY KEY, xid bigint NOT NULL DEFAULT txid_current(), at timestamptz NOT NULL DEFAULT clock_timestamp())`,
		`CREATE TABLE ` + commits + ` (xid bigint PRIMARY KEY, at timestamptz NOT NULL)`,
		`CREATE FUNCTION ` + e.schema + `.slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF (SELECT count(*) FROM ` + ran + ` WHERE xid = txid_current()) < 2 THEN RETURN NULL; END IF;
			INSERT INTO ` + commits + ` VALUES (txid_current(), clock_timestamp()) ON CONFLICT DO NOTHING;
			IF FOUND THEN PERFORM pg_sleep(` + fmt.Sprint(sleep.Seconds()) + `); END IF;
			RETURN NULL;
		END $$`,
		`CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON ` + ran + ` DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION ` + e.schema + `.slow_commit()`,
	} {
		if _, err := e.pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	insert := func(key, table string) func(context.Context, pgx.Tx) ([]byte, error) {
		return func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			_, err := tx.Exec(ctx, `INSERT INTO `+table+` (key) VALUES ($1)`, key)
			return []byte(`1`), err
		}
	}
	// The estimate is learnt from lone calls (committed at once: their
	// table has no trigger), then waves come while the groups before them
	// commit.
	warm := e.schema + ".warm"
	if _, err := e.pool.Exec(ctx, `CREATE TABLE `+warm+` (key text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	for i := range 8 {
		key := fmt.Sprintf("warm%d", i)
		if _, err := e.store.RunTx(ctx, params("credit", key), insert(key, warm)); err != nil {
			t.Fatal(err)
		}
	}
	// A round of waves, each coming while the groups before it commit.
	// Under a loaded scheduler a wave may split into groups that hold
	// every flusher at once; a round is tried again, up to three times.
	// Groups that run one after another never overlap in any round.
	const waves, per, rounds = 4, 10, 3
	overlaps := 0
	for round := 0; round < rounds && overlaps == 0; round++ {
		var wg sync.WaitGroup
		for w := range waves {
			for i := range per {
				wg.Go(func() {
					time.Sleep(time.Duration(w) * sleep / 3)
					key := fmt.Sprintf("wave%d-%d-%d", round, w, i)
					if _, err := e.store.RunTx(ctx, params("credit", key), insert(key, ran)); err != nil {
						t.Errorf("%s: %v", key, err)
					}
				})
			}
		}
		wg.Wait()
		want := (round + 1) * waves * per
		if got := e.count(t, `SELECT count(*) FROM `+ran+` WHERE key LIKE 'wave%'`); got != want {
			t.Fatalf("%d effects, want %d", got, want)
		}
		if got := e.count(t, `SELECT count(*) FROM `+e.schema+`.records WHERE key LIKE 'wave%' AND status = 'completed'`); got != want {
			t.Fatalf("%d completed records, want %d", got, want)
		}
		// Some function of another transaction ran while a group was in
		// its commit.
		overlaps = e.count(t, `SELECT count(*) FROM `+ran+` f JOIN `+commits+` c
			ON f.xid <> c.xid AND f.at >= c.at AND f.at < c.at + $1::interval`, fmt.Sprintf("%d milliseconds", sleep.Milliseconds()))
		t.Logf("round %d: %d functions ran during another group's commit; %d transactions", round, overlaps,
			e.count(t, `SELECT count(DISTINCT xid) FROM `+ran+` WHERE key LIKE $1`, fmt.Sprintf("wave%d-%%", round)))
	}
	if overlaps == 0 {
		t.Errorf("no function ran while a group committed in %d rounds: groups ran one after another", rounds)
	}
}

// TestAdaptiveGroupDuplicateDuringCompletion: an adaptive group gives up
// its turn before its completion statement; the next group, holding
// another delivery of one of its operations, claims while that completion
// (made slow by a trigger) is under way. The duplicate waits for the first
// group's commit and is answered from the record: one effect, no deadlock,
// every other call committed once.
func TestAdaptiveGroupDuplicateDuringCompletion(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{})
	ctx := context.Background()
	tbl := e.effects(t)
	const sleep = 300 * time.Millisecond
	for _, q := range []string{
		`CREATE FUNCTION ` + e.schema + `.slow_complete() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			PERFORM pg_sleep(` + fmt.Sprint(sleep.Seconds()) + `);
			RETURN NEW;
		END $$`,
		`CREATE TRIGGER slow_complete BEFORE UPDATE ON ` + e.schema + `.records FOR EACH ROW
		WHEN (NEW.key = 'slow' AND NEW.status = 'completed' AND OLD.status = 'claimed')
		EXECUTE FUNCTION ` + e.schema + `.slow_complete()`,
	} {
		if _, err := e.pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	var mu sync.Mutex
	started := map[string]time.Time{}
	insert := func(key string) func(context.Context, pgx.Tx) ([]byte, error) {
		return func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			mu.Lock()
			started[key] = time.Now()
			mu.Unlock()
			_, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ($1, 1)`, key)
			return []byte(`"` + key + `"`), err
		}
	}
	for i := range 8 { // the estimate, from lone calls
		key := fmt.Sprintf("warm%d", i)
		if _, err := e.store.RunTx(ctx, params("credit", key), insert(key)); err != nil {
			t.Fatal(err)
		}
	}
	type call struct {
		key string
		at  time.Duration
	}
	var calls []call
	for i := range 6 {
		calls = append(calls, call{fmt.Sprintf("a%d", i), 0})
		calls = append(calls, call{fmt.Sprintf("b%d", i), sleep / 3})
	}
	calls = append(calls, call{"slow", 0}, call{"dup", 0}, call{"dup", sleep / 3}, call{"dup", sleep / 2})
	var wg sync.WaitGroup
	claims := make([]idempotency.Claim, len(calls))
	errs := make([]error, len(calls))
	for i, c := range calls {
		wg.Go(func() {
			time.Sleep(c.at)
			p := params("credit", c.key)
			p.TaskID = fmt.Sprintf("tid-%d", i)
			claims[i], errs[i] = e.store.RunTx(ctx, p, insert(c.key))
			if c.key == "slow" {
				mu.Lock()
				started["slow answered"] = time.Now()
				mu.Unlock()
			}
		})
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("calls not answered within 20 s")
	}
	overlapped := 0
	for k, at := range started {
		if k[0] == 'b' && at.Before(started["slow answered"]) && at.After(started["slow"]) {
			overlapped++
		}
	}
	t.Logf("%d functions of later calls ran while the slow call's group completed", overlapped)
	firsts := map[string]int{}
	for i, c := range calls {
		if errs[i] != nil {
			t.Fatalf("%s (call %d): %v", c.key, i, errs[i])
		}
		switch claims[i].Outcome {
		case idempotency.OutcomeFirst:
			firsts[c.key]++
		case idempotency.OutcomeCompleted:
			if c.key != "dup" || string(claims[i].Result) != `"dup"` {
				t.Fatalf("%s (call %d) answered %+v", c.key, i, claims[i])
			}
		default:
			t.Fatalf("%s (call %d) answered %+v", c.key, i, claims[i])
		}
	}
	if firsts["dup"] != 1 || e.count(t, `SELECT count(*) FROM `+tbl+` WHERE key = 'dup'`) != 1 {
		t.Fatalf("dup: %d first answers, %d effects, want one each", firsts["dup"], e.count(t, `SELECT count(*) FROM `+tbl+` WHERE key = 'dup'`))
	}
	if got, want := e.count(t, `SELECT count(*) FROM `+tbl+` WHERE key NOT LIKE 'warm%'`), len(calls)-2; got != want {
		t.Fatalf("%d effects, want %d", got, want)
	}
	if got := e.count(t, `SELECT count(*) FROM `+e.schema+`.records WHERE status <> 'completed' OR message IS NOT NULL`); got != 0 {
		t.Fatalf("%d records not completed or keeping a message", got)
	}
	if got := e.count(t, `SELECT duplicate_count FROM `+e.schema+`.records WHERE key = 'dup'`); got != 2 {
		t.Fatalf("dup: %d duplicates counted, want 2", got)
	}
}
