// Command refunds is a worker binary of its own: it serves the Celery task
// billing.refund, written in Go, and has every subcommand of onceler
// (worker, migrate, records, resolve, repeats, purge, quarantine, ...).
// Python sends the task with app.send_task("billing.refund", args=[order_id, cents]).
package main

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/cmd"
	"github.com/onceler/onceler/tasks"
)

// RefundArgs binds the Celery args by position and the kwargs by name.
type RefundArgs struct {
	OrderID string `celery:"order_id"`
	Cents   int64  `celery:"cents"`
}

func main() {
	cmd.Main(cmd.App{Name: "refunds", Register: register, Migrate: migrate})
}

// register adds the binary's tasks; the worker calls it once at start.
func register(_ context.Context, reg *tasks.Registry, _ cmd.Env) error {
	return tasks.Register(reg, tasks.Task[RefundArgs]{
		Name: "billing.refund",
		Mode: tasks.ModeSameDB, // the insert commits in the record's transaction: once
		Key:  func(a RefundArgs) (string, error) { return a.OrderID, nil },
		RunTx: func(ctx context.Context, tx pgx.Tx, _ *tasks.Call, a RefundArgs) (any, error) {
			if a.Cents <= 0 {
				return nil, tasks.ValueError("cents must be positive") // raised in the caller
			}
			_, err := tx.Exec(ctx, `INSERT INTO refunds (order_id, cents) VALUES ($1, $2)`, a.OrderID, a.Cents)
			if err != nil {
				return nil, fmt.Errorf("insert refund: %w", err)
			}
			return map[string]any{"order_id": a.OrderID, "refunded": a.Cents}, nil
		},
	})
}

// migrate creates the binary's own table, after the record schema: run by
// "refunds migrate" and "refunds worker --migrate", one process at a time.
// order_id is deliberately not unique: the record is what keeps a refund
// from happening twice.
func migrate(ctx context.Context, pool *pgxpool.Pool) error {
	_, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS refunds (
		id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
		order_id   text NOT NULL,
		cents      bigint NOT NULL,
		created_at timestamptz NOT NULL DEFAULT now()
	)`)
	if err != nil {
		return fmt.Errorf("create table refunds: %w", err)
	}
	return nil
}
