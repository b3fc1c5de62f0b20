// Command example serves one Celery task written in Go: billing.refund,
// which Python sends with app.send_task("billing.refund", args=[order_id, cents]).
package main

import (
	"context"
	"log"
	"os"
	"os/signal"
	"syscall"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/tasks"
)

// RefundArgs binds the Celery args by position and the kwargs by name.
type RefundArgs struct {
	OrderID string `celery:"order_id"`
	Cents   int64  `celery:"cents"`
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL")) // record schema: `onceler migrate`
	if err != nil {
		log.Fatal(err)
	}
	reg := tasks.NewRegistry()
	err = tasks.Register(reg, tasks.Task[RefundArgs]{
		Name: "billing.refund",
		Mode: tasks.ModeSameDB, // the effect commits in the record's transaction
		Key:  func(a RefundArgs) (string, error) { return a.OrderID, nil },
		RunTx: func(ctx context.Context, tx pgx.Tx, _ *tasks.Call, a RefundArgs) (any, error) {
			_, err := tx.Exec(ctx, "INSERT INTO refunds (order_id, cents) VALUES ($1, $2)", a.OrderID, a.Cents)
			return map[string]any{"refunded": a.Cents}, err
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	w, err := tasks.NewWorker(reg, tasks.Config{Broker: amqp.Config{URL: os.Getenv("BROKER_URL")}, Pool: pool})
	if err == nil {
		err = w.Run(ctx) // until SIGINT or SIGTERM, then a graceful shutdown
	}
	if err != nil {
		log.Fatal(err)
	}
}
