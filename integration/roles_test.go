package integration

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/internal/testenv"
)

// demoGrants are the privileges the demo tasks need on their own tables
// (schema onceler_demo): the user's grants, not the record's, given as a
// binary's owner gives them for its own tables.
func demoGrants(role string) []string {
	r := pgx.Identifier{role}.Sanitize()
	return []string{
		"GRANT USAGE ON SCHEMA " + demo.Schema + " TO " + r,
		"GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA " + demo.Schema + " TO " + r,
		"GRANT USAGE ON ALL SEQUENCES IN SCHEMA " + demo.Schema + " TO " + r,
	}
}

// execRetry runs q again while a concurrent change of the same object's
// privileges makes it fail ("tuple concurrently updated").
func execRetry(ctx context.Context, pool *pgxpool.Pool, q string) error {
	var err error
	for range 20 {
		if _, err = pool.Exec(ctx, q); err == nil {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("%s: %w", q, err)
}

// TestReplayAsWorkerRole runs the replay suite's "repeated" (each message
// three times) and "crash_after_claim" scenarios with every worker
// connected as a role that has only what 'onceler migrate --grant-to'
// grants on the record (and the demo tasks' grants on their own tables):
// a same-database task and an outside task whose policy is lookup. The
// suite migrates and inspects as the superuser.
func TestReplayAsWorkerRole(t *testing.T) {
	t.Parallel()
	roleURL, prepare := workerRole(t)
	for _, tg := range demoTargets() {
		if tg.Task != demo.TaskCredit && tg.Task != demo.TaskCharge {
			continue
		}
		tg.Command = []string{"worker"} // the role may not migrate
		tg.Scenarios = []replay.Scenario{replay.ScenarioRepeated, replay.ScenarioCrashAfterClaim}
		tg.WorkerDatabaseURL, tg.Prepare = roleURL, prepare
		t.Run(tg.Task, func(t *testing.T) { replay.Run(t, tg) })
	}
}

// workerRole makes a LOGIN role of the test's own and returns its URL and
// a replay Prepare that grants it, on each scenario's schema, what
// 'onceler migrate --grant-to' grants, and the demo tasks' grants on
// their own tables. When the test ends, it fails unless a session of the
// role was seen: the workers connected as it.
func workerRole(t *testing.T) (roleURL string, prepare func(context.Context, *replay.Env) error) {
	t.Helper()
	pool := testenv.Pool(t)
	role, roleURL := testenv.Role(t, pool)
	prepare = func(ctx context.Context, e *replay.Env) error {
		if err := demo.Migrate(ctx, e.Pool); err != nil {
			return err
		}
		qs := idempotency.GrantStatements(e.Schema, role, idempotency.WorkerPrivileges())
		for _, q := range append(qs, demoGrants(role)...) {
			if err := execRetry(ctx, e.Pool, q); err != nil {
				return err
			}
		}
		return nil
	}
	seen := make(chan int, 1)
	stop := make(chan struct{})
	go func() {
		most := 0
		defer func() { seen <- most }()
		for {
			var n int
			if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity WHERE usename = $1`, role).Scan(&n); err == nil {
				most = max(most, n)
			}
			select {
			case <-stop:
				return
			case <-time.After(200 * time.Millisecond):
			}
		}
	}()
	t.Cleanup(func() {
		close(stop)
		if most := <-seen; most == 0 {
			t.Errorf("no session of role %s was seen: the workers did not connect as it", role)
		}
	})
	return roleURL, prepare
}
