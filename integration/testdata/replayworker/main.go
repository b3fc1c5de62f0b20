// Command replayworker is the project's own "binary of your own" for the
// replay suite: a worker wired with tasks.NewWorker that serves the demo
// tasks and tasks of its own, and takes its settings from the environment
// variables the suite sets (ONCELER_BROKER_URL, ONCELER_DATABASE_URL,
// ONCELER_SCHEMA, ONCELER_QUEUES, ONCELER_LEASE, ONCELER_HOSTNAME,
// ONCELER_CONCURRENCY, ONCELER_PREFETCH, ONCELER_NO_RECORD, ONCELER_QUORUM,
// ONCELER_CRASH_AT, ONCELER_CRASH_TASK; see integration/replay). Crash
// injection and ONCELER_NO_RECORD go through internal/workerhooks, which
// only this module can import: a binary outside it gets them from cmd.Main.
// Its own tasks:
//
//   - replay.notify(op): calls an outside service that keeps every call (a row
//     in onceler_replay.effects); stale-claim policy retry.
//   - replay.audit(op): the same outside service; stale-claim policy skip.
//   - replay.slow(op, seconds): sleeps, then calls the service; policy retry.
//     For stop-and-continue tests.
//   - replay.nul(op): calls the service and returns a result holding a NUL
//     (which PostgreSQL's jsonb refuses as it is); policy retry.
//   - replay.swallow(op): same-database; writes its row, then catches the
//     error of a statement that fails and returns nil (its transaction is
//     aborted: the task fails).
//   - replay.deferred(op): same-database; writes a row whose deferred
//     foreign key fails at COMMIT (the task fails).
//
// The outside service's table (onceler_replay.effects, the calls of
// replay.notify, replay.audit, replay.slow and replay.nul) is in the
// worker's database, or in ONCELER_OUTSIDE_DATABASE_URL's when that is set:
// an outside system that survives what happens to the worker's database (a
// failover that loses commits).
//
// ONCELER_HEARTBEAT sets the broker heartbeat (default 10s);
// ONCELER_DATABASE_DEAD_AFTER the bound on detecting a dead PostgreSQL
// connection (default 15s, see idempotency.ConfigureDeadConnectionDetection).
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/workerhooks"
	"github.com/onceler/onceler/tasks"
)

// OpArgs are the arguments of replay.notify and replay.audit.
type OpArgs struct {
	Op string `celery:"op"`
}

// SlowArgs are the arguments of replay.slow.
type SlowArgs struct {
	Op      string  `celery:"op"`
	Seconds float64 `celery:"seconds"`
}

const ddl = `
CREATE SCHEMA IF NOT EXISTS onceler_replay;
CREATE TABLE IF NOT EXISTS onceler_replay.effects (
	task    text        NOT NULL,
	op      text        NOT NULL,
	task_id text        NOT NULL,
	at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS effects_op ON onceler_replay.effects (op);
CREATE TABLE IF NOT EXISTS onceler_replay.parents (id int PRIMARY KEY);
CREATE TABLE IF NOT EXISTS onceler_replay.deferred (
	op     text PRIMARY KEY,
	parent int  REFERENCES onceler_replay.parents DEFERRABLE INITIALLY DEFERRED
);
`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	context.AfterFunc(ctx, stop) // a second signal ends the process at once
	err := run(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "replayworker:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context) error {
	logger, err := zap.NewProduction()
	if err != nil {
		return err
	}
	defer func() { _ = logger.Sync() }()
	env := func(name, def string) string {
		if v := os.Getenv(name); v != "" {
			return v
		}
		return def
	}
	duration := func(name string, def time.Duration) (time.Duration, error) {
		d, err := time.ParseDuration(env(name, def.String()))
		if err != nil {
			return 0, fmt.Errorf("%s: %w", name, err)
		}
		return d, nil
	}
	number := func(name string) (int, error) {
		n, err := strconv.Atoi(env(name, "0"))
		if err != nil {
			return 0, fmt.Errorf("%s: %w", name, err)
		}
		return n, nil
	}
	lease, err := duration("ONCELER_LEASE", 30*time.Second)
	if err != nil {
		return err
	}
	heartbeat, err := duration("ONCELER_HEARTBEAT", 10*time.Second)
	if err != nil {
		return err
	}
	concurrency, err := number("ONCELER_CONCURRENCY")
	if err != nil {
		return err
	}
	prefetch, err := number("ONCELER_PREFETCH")
	if err != nil {
		return err
	}
	noRecord, _ := strconv.ParseBool(env("ONCELER_NO_RECORD", "false"))
	quorum, _ := strconv.ParseBool(env("ONCELER_QUORUM", "false"))

	deadAfter, err := duration("ONCELER_DATABASE_DEAD_AFTER", idempotency.DefaultDeadConnectionAfter)
	if err != nil {
		return err
	}
	pcfg, err := pgxpool.ParseConfig(env("ONCELER_DATABASE_URL", ""))
	if err != nil {
		return fmt.Errorf("database: %w", err)
	}
	idempotency.ConfigureDeadConnectionDetection(pcfg, deadAfter)
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return fmt.Errorf("database: %w", err)
	}
	defer pool.Close()
	store, err := idempotency.New(pool, idempotency.Config{Schema: env("ONCELER_SCHEMA", idempotency.DefaultSchema), Logger: logger})
	if err != nil {
		return err
	}
	defer store.Close()
	if err := store.Migrate(ctx); err != nil {
		return err
	}
	if err := demo.Migrate(ctx, pool); err != nil {
		return err
	}
	if err := migrate(ctx, pool); err != nil {
		return err
	}
	outside := pool
	if u := env("ONCELER_OUTSIDE_DATABASE_URL", ""); u != "" {
		if outside, err = pgxpool.New(ctx, u); err != nil {
			return fmt.Errorf("outside database: %w", err)
		}
		defer outside.Close()
		if err := migrate(ctx, outside); err != nil {
			return fmt.Errorf("outside database: %w", err)
		}
	}

	reg := tasks.NewRegistry()
	if err := demo.Register(reg, pool, demo.WithLogger(logger)); err != nil {
		return err
	}
	effect := func(name string) func(context.Context, *tasks.Call, OpArgs) (any, error) {
		return func(ctx context.Context, c *tasks.Call, a OpArgs) (any, error) {
			if err := record(ctx, outside, name, a.Op, c.TaskID); err != nil {
				return nil, err
			}
			return map[string]any{"op": a.Op}, nil
		}
	}
	key := func(a OpArgs) (string, error) { return a.Op, nil }
	err = errors.Join(
		tasks.Register(reg, tasks.Task[OpArgs]{Name: "replay.notify", Mode: tasks.ModeOutside, Key: key,
			Policy: tasks.PolicyRetry, Run: effect("replay.notify")}),
		tasks.Register(reg, tasks.Task[OpArgs]{Name: "replay.audit", Mode: tasks.ModeOutside, Key: key,
			Policy: tasks.PolicySkip, Run: effect("replay.audit")}),
		tasks.Register(reg, tasks.Task[SlowArgs]{Name: "replay.slow", Mode: tasks.ModeOutside,
			Key:    func(a SlowArgs) (string, error) { return a.Op, nil },
			Policy: tasks.PolicyRetry,
			Run: func(ctx context.Context, c *tasks.Call, a SlowArgs) (any, error) {
				t := time.NewTimer(time.Duration(a.Seconds * float64(time.Second)))
				defer t.Stop()
				select {
				case <-t.C:
				case <-ctx.Done():
					return nil, fmt.Errorf("slow task interrupted: %w", context.Cause(ctx))
				}
				if err := record(ctx, outside, "replay.slow", a.Op, c.TaskID); err != nil {
					return nil, err
				}
				return map[string]any{"op": a.Op}, nil
			}}),
		tasks.Register(reg, tasks.Task[OpArgs]{Name: "replay.nul", Mode: tasks.ModeOutside, Key: key,
			Policy: tasks.PolicyRetry,
			Run: func(ctx context.Context, c *tasks.Call, a OpArgs) (any, error) {
				if err := record(ctx, outside, "replay.nul", a.Op, c.TaskID); err != nil {
					return nil, err
				}
				return map[string]any{"op": a.Op, "text": "a\x00b"}, nil
			}}),
		tasks.Register(reg, tasks.Task[OpArgs]{Name: "replay.swallow", Mode: tasks.ModeSameDB, Key: key,
			RunTx: func(ctx context.Context, tx pgx.Tx, c *tasks.Call, a OpArgs) (any, error) {
				if err := recordTx(ctx, tx, "replay.swallow", a.Op, c.TaskID); err != nil {
					return nil, err
				}
				_, _ = tx.Exec(ctx, `SELECT 1/0`) // caught: "already done", the task thinks
				return map[string]any{"op": a.Op}, nil
			}}),
		tasks.Register(reg, tasks.Task[OpArgs]{Name: "replay.deferred", Mode: tasks.ModeSameDB, Key: key,
			RunTx: func(ctx context.Context, tx pgx.Tx, c *tasks.Call, a OpArgs) (any, error) {
				if err := recordTx(ctx, tx, "replay.deferred", a.Op, c.TaskID); err != nil {
					return nil, err
				}
				_, err := tx.Exec(ctx, `INSERT INTO onceler_replay.deferred VALUES ($1, -1)`, a.Op) // no parent -1
				return map[string]any{"op": a.Op}, err
			}}),
	)
	if err != nil {
		return err
	}

	var queues []amqp.QueueSpec
	for _, q := range strings.Split(env("ONCELER_QUEUES", "celery"), ",") {
		spec := amqp.CeleryQueue(q)
		spec.Quorum = quorum
		queues = append(queues, spec)
	}
	hostname := env("ONCELER_HOSTNAME", "")
	cfg := tasks.Config{
		Broker:      amqp.Config{URL: env("ONCELER_BROKER_URL", ""), Name: hostname, Heartbeat: heartbeat, Logger: logger},
		Queues:      queues,
		Pool:        pool,
		Store:       store,
		Concurrency: concurrency,
		Prefetch:    prefetch,
		Lease:       lease,
		Grace:       5 * time.Second,
		Hostname:    hostname,
		Logger:      logger,
	}
	// Crash injection and running without the record are no part of
	// package tasks' API: this binary, inside the module, sets them through
	// internal/workerhooks; a binary of your own made with cmd.Main gets
	// them from the same variables.
	workerhooks.Set(&cfg, workerhooks.Hooks{NoRecord: noRecord, Crash: workerhooks.CrashFromEnv(os.Getenv)})
	w, err := tasks.NewWorker(reg, cfg)
	if err != nil {
		return err
	}
	return w.Run(ctx)
}

// migrate creates the outside service's table (serialised: concurrent
// CREATE ... IF NOT EXISTS can collide).
func migrate(ctx context.Context, pool *pgxpool.Pool) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(7265706)`); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, ddl)
		return err
	})
}

// recordTx keeps a call of a same-database task in its transaction.
func recordTx(ctx context.Context, tx pgx.Tx, task, op, taskID string) error {
	_, err := tx.Exec(ctx, `INSERT INTO onceler_replay.effects (task, op, task_id) VALUES ($1, $2, $3)`, task, op, taskID)
	if err != nil {
		return fmt.Errorf("effects: %w", err)
	}
	return nil
}

// record is the outside service: it keeps every call, in its own
// transaction.
func record(ctx context.Context, pool *pgxpool.Pool, task, op, taskID string) error {
	_, err := pool.Exec(ctx, `INSERT INTO onceler_replay.effects (task, op, task_id) VALUES ($1, $2, $3)`, task, op, taskID)
	if err != nil {
		return fmt.Errorf("outside service: %w", err)
	}
	return nil
}
