package demo

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// migrateLock is the advisory lock key that serialises concurrent Migrate
// calls (CREATE ... IF NOT EXISTS can still collide when run concurrently).
const migrateLock = 0x6f6e63656c6572 // "onceler"

const ddl = `
CREATE SCHEMA IF NOT EXISTS onceler_demo;
CREATE TABLE IF NOT EXISTS onceler_demo.ledger (
	entry_id   text        NOT NULL,
	account    text        NOT NULL,
	cents      bigint      NOT NULL,
	task_id    text        NOT NULL,
	created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS ledger_entry_id ON onceler_demo.ledger (entry_id);
CREATE INDEX IF NOT EXISTS ledger_account ON onceler_demo.ledger (account);
CREATE TABLE IF NOT EXISTS onceler_demo.balances (
	account text   PRIMARY KEY,
	cents   bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS onceler_demo.gateway_calls (
	reference text        NOT NULL,
	order_id  text        NOT NULL,
	cents     bigint      NOT NULL,
	at        timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS gateway_calls_order_id ON onceler_demo.gateway_calls (order_id);
CREATE TABLE IF NOT EXISTS onceler_demo.gateway_charges (
	reference text        NOT NULL UNIQUE,
	order_id  text        NOT NULL,
	cents     bigint      NOT NULL,
	at        timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS gateway_charges_order_id ON onceler_demo.gateway_charges (order_id);
CREATE TABLE IF NOT EXISTS onceler_demo.email_sends (
	message_id text        NOT NULL,
	to_addr    text        NOT NULL,
	subject    text        NOT NULL,
	at         timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS email_sends_message_id ON onceler_demo.email_sends (message_id);
CREATE TABLE IF NOT EXISTS onceler_demo.sleeps (
	op      text        NOT NULL,
	task_id text        NOT NULL,
	at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS sleeps_op ON onceler_demo.sleeps (op);
`

// Migrate creates the schema onceler_demo and its tables when missing. It is
// safe to call concurrently and again.
func Migrate(ctx context.Context, pool *pgxpool.Pool) error {
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, int64(migrateLock)); err != nil {
			return fmt.Errorf("lock: %w", err)
		}
		var fresh bool
		if err := tx.QueryRow(ctx, `SELECT to_regclass('onceler_demo.balances') IS NULL`).Scan(&fresh); err != nil {
			return fmt.Errorf("look for the balances table: %w", err)
		}
		if _, err := tx.Exec(ctx, ddl); err != nil {
			return fmt.Errorf("create tables: %w", err)
		}
		if fresh {
			// A ledger from before the balances table: its balances.
			if _, err := tx.Exec(ctx, `INSERT INTO onceler_demo.balances (account, cents)
				SELECT account, sum(cents) FROM onceler_demo.ledger GROUP BY account`); err != nil {
				return fmt.Errorf("fill the balances: %w", err)
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("migrate demo tables: %w", err)
	}
	return nil
}

// Querier is what the Count functions query: a *pgxpool.Pool, *pgx.Conn or
// pgx.Tx.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

func count(ctx context.Context, q Querier, sql, key string) (int, error) {
	var n int
	if err := q.QueryRow(ctx, sql, key).Scan(&n); err != nil {
		return 0, fmt.Errorf("count demo effects: %w", err)
	}
	return n, nil
}

// CountLedger returns how many ledger rows carry entryID.
func CountLedger(ctx context.Context, q Querier, entryID string) (int, error) {
	return count(ctx, q, `SELECT count(*) FROM onceler_demo.ledger WHERE entry_id = $1`, entryID)
}

// Balance returns the sum of an account's ledger rows, in cents.
func Balance(ctx context.Context, q Querier, account string) (int64, error) {
	var n int64
	err := q.QueryRow(ctx, `SELECT coalesce(sum(cents), 0)::bigint FROM onceler_demo.ledger WHERE account = $1`, account).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("read balance: %w", err)
	}
	return n, nil
}

// CountGatewayCalls returns how many times the gateway was called for orderID.
func CountGatewayCalls(ctx context.Context, q Querier, orderID string) (int, error) {
	return count(ctx, q, `SELECT count(*) FROM onceler_demo.gateway_calls WHERE order_id = $1`, orderID)
}

// CountGatewayCharges returns how many charges the gateway holds for orderID
// (0 or 1: the gateway de-duplicates by reference).
func CountGatewayCharges(ctx context.Context, q Querier, orderID string) (int, error) {
	return count(ctx, q, `SELECT count(*) FROM onceler_demo.gateway_charges WHERE order_id = $1`, orderID)
}

// CountEmailSends returns how many times messageID was sent.
func CountEmailSends(ctx context.Context, q Querier, messageID string) (int, error) {
	return count(ctx, q, `SELECT count(*) FROM onceler_demo.email_sends WHERE message_id = $1`, messageID)
}

// CountSleeps returns how many demo.sleep runs for op completed.
func CountSleeps(ctx context.Context, q Querier, op string) (int, error) {
	return count(ctx, q, `SELECT count(*) FROM onceler_demo.sleeps WHERE op = $1`, op)
}
