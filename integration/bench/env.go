package main

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/idempotency"
)

// ensureDatabase creates the bench database when it does not exist. The
// bench has a database of its own so that pg_stat_database's commit count
// holds its load alone.
func ensureDatabase(ctx context.Context, dbURL string) error {
	c, err := pgx.Connect(ctx, dbURL)
	if err == nil {
		return c.Close(ctx)
	}
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "3D000" {
		return fmt.Errorf("connect to the bench database: %w", err)
	}
	cfg, err := pgx.ParseConfig(dbURL)
	if err != nil {
		return fmt.Errorf("parse database url: %w", err)
	}
	name := cfg.Database
	admin, err := pgx.Connect(ctx, withDatabase(dbURL, "postgres"))
	if err != nil {
		return fmt.Errorf("connect to database postgres to create %s: %w", name, err)
	}
	defer func() { _ = admin.Close(ctx) }()
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return fmt.Errorf("create database %s: %w", name, err)
	}
	return nil
}

// withDatabase returns dbURL naming another database.
func withDatabase(dbURL, db string) string {
	u, err := url.Parse(dbURL)
	if err != nil {
		return dbURL
	}
	u.Path = "/" + db
	return u.String()
}

// commitCounter reads the bench database's committed transactions from a
// connection to another database, so that reading does not count.
type commitCounter struct {
	conn *pgx.Conn
	db   string
}

func newCommitCounter(ctx context.Context, dbURL string) (*commitCounter, error) {
	cfg, err := pgx.ParseConfig(dbURL)
	if err != nil {
		return nil, fmt.Errorf("parse database url: %w", err)
	}
	c, err := pgx.Connect(ctx, withDatabase(dbURL, "postgres"))
	if err != nil {
		return nil, fmt.Errorf("connect to database postgres for statistics: %w", err)
	}
	return &commitCounter{conn: c, db: cfg.Database}, nil
}

// read returns xact_commit of the bench database after the statistics of
// exited backends have reached the cumulative view.
func (c *commitCounter) read(ctx context.Context) (int64, error) {
	time.Sleep(700 * time.Millisecond)
	var n int64
	err := c.conn.QueryRow(ctx, `SELECT xact_commit FROM pg_stat_database WHERE datname = $1`, c.db).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("read xact_commit: %w", err)
	}
	return n, nil
}

func (c *commitCounter) close(ctx context.Context) { _ = c.conn.Close(ctx) }

// withPool runs fn on a short-lived pool of the bench database, closed
// before it returns so that its backends' statistics are flushed.
func withPool(ctx context.Context, dbURL string, fn func(*pgxpool.Pool) error) error {
	cfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		return fmt.Errorf("parse database url: %w", err)
	}
	cfg.MaxConns = 2
	cfg.ConnConfig.RuntimeParams["application_name"] = "onceler-bench"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return fmt.Errorf("open pool: %w", err)
	}
	defer pool.Close()
	return fn(pool)
}

// setupSchema creates a fresh schema with the record's tables, the
// same-database effect table and the Python worker's table.
func setupSchema(ctx context.Context, dbURL, schema string) error {
	return withPool(ctx, dbURL, func(pool *pgxpool.Pool) error {
		s := pgx.Identifier{schema}.Sanitize()
		if _, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+s+" CASCADE"); err != nil {
			return fmt.Errorf("drop schema %s: %w", schema, err)
		}
		st, err := idempotency.New(pool, idempotency.Config{Schema: schema, Batch: idempotency.BatchConfig{Disabled: true}})
		if err != nil {
			return err
		}
		defer st.Close()
		if err := st.Migrate(ctx); err != nil {
			return fmt.Errorf("migrate %s: %w", schema, err)
		}
		_, err = pool.Exec(ctx, `CREATE TABLE `+s+`.bench_effects (op text PRIMARY KEY, at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE `+s+`.py_records (task text NOT NULL, key text NOT NULL, status text NOT NULL, token text NOT NULL,
    claimed_at timestamptz NOT NULL, completed_at timestamptz, PRIMARY KEY (task, key))`)
		if err != nil {
			return fmt.Errorf("create bench tables in %s: %w", schema, err)
		}
		return nil
	})
}

// setupLedger creates the demo tables (demo.Migrate) and empties the
// ledger and the balances, so that every credit scenario starts alike.
func setupLedger(ctx context.Context, dbURL string) error {
	return withPool(ctx, dbURL, func(pool *pgxpool.Pool) error {
		if err := demo.Migrate(ctx, pool); err != nil {
			return err
		}
		if _, err := pool.Exec(ctx, "TRUNCATE onceler_demo.ledger, onceler_demo.balances"); err != nil {
			return fmt.Errorf("empty the demo ledger: %w", err)
		}
		return nil
	})
}

func dropSchema(ctx context.Context, dbURL, schema string) error {
	return withPool(ctx, dbURL, func(pool *pgxpool.Pool) error {
		_, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
		return err
	})
}

// broker is the bench's own administrative connection: queue depths and
// deleting the bench's queues.
type broker struct {
	conn *amqp091.Connection
}

func dialBroker(amqpURL string) (*broker, error) {
	c, err := amqp091.DialConfig(amqpURL, amqp091.Config{Properties: amqp091.Table{"connection_name": "onceler-bench-admin"}})
	if err != nil {
		return nil, fmt.Errorf("dial broker: %w", err)
	}
	return &broker{conn: c}, nil
}

func (b *broker) close() { _ = b.conn.Close() }

// depth returns the ready messages of queue.
func (b *broker) depth(queue string) (int, error) {
	ch, err := b.conn.Channel()
	if err != nil {
		return 0, fmt.Errorf("channel: %w", err)
	}
	defer func() { _ = ch.Close() }()
	q, err := ch.QueueDeclarePassive(queue, false, false, false, false, nil)
	if err != nil {
		return 0, fmt.Errorf("inspect queue %s: %w", queue, err)
	}
	return q.Messages, nil
}

// declareReply declares a reply queue as Celery's rpc backend does (not
// durable, auto-delete, x-expires), with a shorter expiry.
func (b *broker) declareReply(queue string) error {
	ch, err := b.conn.Channel()
	if err != nil {
		return fmt.Errorf("channel: %w", err)
	}
	defer func() { _ = ch.Close() }()
	_, err = ch.QueueDeclare(queue, false, true, false, false, amqp091.Table{"x-expires": int32(600000)})
	if err != nil {
		return fmt.Errorf("declare reply queue %s: %w", queue, err)
	}
	return nil
}

// deleteQueues deletes the bench's own queues, and the exchange of the same
// name that a Celery queue declaration creates.
func (b *broker) deleteQueues(names ...string) {
	for _, n := range names {
		b.onChannel(func(ch *amqp091.Channel) error { _, err := ch.QueueDelete(n, false, false, false); return err })
		if !strings.HasSuffix(n, ".quarantine") && !strings.HasSuffix(n, ".reply") {
			b.onChannel(func(ch *amqp091.Channel) error { return ch.ExchangeDelete(n, false, false) })
		}
	}
}

// onChannel runs fn on a fresh channel: a refused operation closes only it.
func (b *broker) onChannel(fn func(*amqp091.Channel) error) {
	ch, err := b.conn.Channel()
	if err != nil {
		return
	}
	defer func() { _ = ch.Close() }()
	_ = fn(ch)
}
