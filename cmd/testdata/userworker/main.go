// Command userworker is a user's own worker binary, wired with the library
// (tasks.NewWorker and Run, without package cmd), for the tests of what such a
// binary does at start.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/tasks"
)

type payArgs struct {
	OrderID string `celery:"order_id"`
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "userworker:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context) error {
	pool, err := pgxpool.New(ctx, os.Getenv("ONCELER_DATABASE_URL"))
	if err != nil {
		return err
	}
	defer pool.Close()
	store, err := idempotency.New(pool, idempotency.Config{Schema: os.Getenv("ONCELER_SCHEMA")})
	if err != nil {
		return err
	}
	reg := tasks.NewRegistry()
	err = tasks.Register(reg, tasks.Task[payArgs]{Name: "user.pay", Mode: tasks.ModeOutside,
		Key: func(a payArgs) (string, error) { return a.OrderID, nil },
		Run: func(context.Context, *tasks.Call, payArgs) (any, error) { return "paid", nil }})
	if err != nil {
		return err
	}
	w, err := tasks.NewWorker(reg, tasks.Config{Broker: amqp.Config{URL: os.Getenv("ONCELER_BROKER_URL")}, Pool: pool, Store: store,
		Queues: []amqp.QueueSpec{amqp.CeleryQueue(os.Getenv("ONCELER_QUEUES"))}})
	if err != nil {
		return err
	}
	return w.Run(ctx)
}
