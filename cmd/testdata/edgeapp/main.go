// Command edgeapp is a user's own binary built on package cmd, whose
// Register and Migrate misbehave as the environment asks, for the edge tests
// of cmd.Main (app_edges_test.go):
//
//	EDGE_MIGRATE=panic   Migrate panics
//	EDGE_MIGRATE=error   Migrate fails with a PostgreSQL error it wraps
//	EDGE_MIGRATE=naive   Migrate creates its table without a lock of its own
//	EDGE_REGISTER=panic  Register panics
//
// Otherwise it serves edge.pay, an outside task with the default stale-claim
// policy (hold), whose Run answers "paid".
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/cmd"
	"github.com/onceler/onceler/tasks"
)

type payArgs struct {
	OrderID string `celery:"order_id"`
}

func main() {
	cmd.Main(cmd.App{Name: "payments", Register: register, Migrate: migrate})
}

func register(_ context.Context, reg *tasks.Registry, _ cmd.Env) error {
	if os.Getenv("EDGE_REGISTER") == "panic" {
		panic("register exploded")
	}
	return tasks.Register(reg, tasks.Task[payArgs]{
		Name: "edge.pay",
		Mode: tasks.ModeOutside,
		Key:  func(a payArgs) (string, error) { return a.OrderID, nil },
		Run:  func(context.Context, *tasks.Call, payArgs) (any, error) { return "paid", nil },
	})
}

func migrate(ctx context.Context, pool *pgxpool.Pool) error {
	switch os.Getenv("EDGE_MIGRATE") {
	case "panic":
		panic("migrate exploded")
	case "naive":
		if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS edge_naive (id bigint PRIMARY KEY, note text)`); err != nil {
			return fmt.Errorf("create table edge_naive: %w", err)
		}
	case "error":
		if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS edge_payments (id no_such_type)`); err != nil {
			return fmt.Errorf("create table edge_payments: %w", err)
		}
	}
	return nil
}
