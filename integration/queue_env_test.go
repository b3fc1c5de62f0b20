package integration

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/internal/testkit"
)

// queueEnv is what the Sidekiq and SQS harnesses (skEnv, sqsEnv) share:
// the test's database, its record schema, the workers' lease and their
// processes.
type queueEnv struct {
	t      *testing.T
	dbURL  string
	schema string
	pool   *pgxpool.Pool
	store  *idempotency.Store
	lease  time.Duration

	workerProcs
}

// setupRecord creates the test's record schema (a fresh name under
// prefix) and the demo tables, dropped or killed with the workers when
// the test ends.
func (e *queueEnv) setupRecord(prefix string) {
	t, dbURL := e.t, e.dbURL
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		t.Fatalf("open pool: %v", err)
	}
	t.Cleanup(pool.Close)
	e.pool = pool
	e.schema = testkit.Name(prefix)
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{e.schema}.Sanitize()); err != nil {
		t.Fatalf("create schema: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, _ = pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{e.schema}.Sanitize()+" CASCADE")
	})
	store, err := idempotency.New(pool, idempotency.Config{Schema: e.schema})
	if err != nil {
		t.Fatalf("open record: %v", err)
	}
	t.Cleanup(store.Close)
	if err := store.Migrate(ctx); err != nil {
		t.Fatalf("migrate record: %v", err)
	}
	if err := demo.Migrate(ctx, pool); err != nil {
		t.Fatalf("demo tables: %v", err)
	}
	e.store = store
	t.Cleanup(e.killAll)
}

// stopAll stops every live worker with SIGTERM, failing the test if one
// does not stop within 30 s.
func (e *queueEnv) stopAll() { e.workerProcs.stopAll(e.t) }

// queueWorkerOptions are the settings of one worker process of the
// Sidekiq or SQS harness.
type queueWorkerOptions struct {
	CrashAt, CrashTask    string
	NoRecord              bool
	Concurrency, Prefetch int
	// Queues is --queues (default: the test's queue).
	Queues string
	Env    []string
	// MayCrash: the worker may crash (its crash injection) before the
	// harness sees it started.
	MayCrash bool
}

// workerEnv is the environment of a worker named name with options o on
// queue (o.Queues by default): this process's environment less the
// variables whose names start with one of drop, then transport (the
// transport's settings), the settings both harnesses give, and o.Env
// last.
func (e *queueEnv) workerEnv(o queueWorkerOptions, name, queue string, drop []string, transport ...string) []string {
	if o.Concurrency <= 0 {
		o.Concurrency = 4
	}
	if o.Prefetch <= 0 {
		o.Prefetch = 2 * o.Concurrency
	}
	if o.Queues == "" {
		o.Queues = queue
	}
	var env []string
	for _, kv := range os.Environ() {
		if !hasAnyPrefix(kv, drop) {
			env = append(env, kv)
		}
	}
	env = append(env, transport...)
	env = append(env,
		"ONCELER_QUEUES="+o.Queues,
		"ONCELER_DATABASE_URL="+e.dbURL,
		"ONCELER_SCHEMA="+e.schema,
		"ONCELER_LEASE="+e.lease.String(),
	)
	env = append(env, replay.WorkerSettings(name, o.Concurrency, o.Prefetch, o.NoRecord, o.CrashAt, o.CrashTask)...)
	return append(env, o.Env...)
}

// hasAnyPrefix reports whether s starts with one of prefixes.
func hasAnyPrefix(s string, prefixes []string) bool {
	for _, p := range prefixes {
		if strings.HasPrefix(s, p) {
			return true
		}
	}
	return false
}
