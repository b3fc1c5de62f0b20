package tasks_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/tasks"
)

// ChargeArgs binds billing.charge(order_id, cents, currency="EUR").
type ChargeArgs struct {
	OrderID  string `celery:"order_id"`
	Cents    int64  `celery:"cents"`
	Currency string `celery:"currency,optional"`
}

// CreditArgs binds ledger.credit(entry_id, cents).
type CreditArgs struct {
	EntryID string `celery:"entry_id"`
	Cents   int64  `celery:"cents"`
}

func Example() {
	reg := tasks.NewRegistry()

	// An outside system (a payment gateway): the claim commits first, the
	// gateway gets the operation reference, a stale claim is settled by
	// asking the gateway.
	err := tasks.Register(reg, tasks.Task[ChargeArgs]{
		Name:   "billing.charge",
		Mode:   tasks.ModeOutside,
		Key:    func(a ChargeArgs) (string, error) { return "order:" + a.OrderID, nil },
		Policy: tasks.PolicyLookup, Fallback: tasks.PolicyHold,
		Run: func(ctx context.Context, c *tasks.Call, a ChargeArgs) (any, error) {
			if a.Cents <= 0 {
				return nil, tasks.ValueError("cents must be positive")
			}
			// gateway.Charge(ctx, c.Reference, a.Cents)
			return map[string]any{"charged": a.Cents, "reference": c.Reference}, nil
		},
		Lookup: func(ctx context.Context, c *tasks.Call, a ChargeArgs) (any, bool, error) {
			// return gateway.Find(ctx, c.Reference)
			return nil, false, nil
		},
	})
	fmt.Println("charge:", err)

	// The effect lives in the record's own database: one transaction.
	err = tasks.Register(reg, tasks.Task[CreditArgs]{
		Name: "ledger.credit",
		Mode: tasks.ModeSameDB,
		Key:  func(a CreditArgs) (string, error) { return a.EntryID, nil },
		RunTx: func(ctx context.Context, tx pgx.Tx, c *tasks.Call, a CreditArgs) (any, error) {
			_, err := tx.Exec(ctx, "INSERT INTO ledger (entry_id, cents) VALUES ($1, $2)", a.EntryID, a.Cents)
			return a.Cents, err
		},
	})
	fmt.Println("credit:", err)

	// Touching the outside world without an operation key is refused.
	err = tasks.Register(reg, tasks.Task[ChargeArgs]{
		Name: "billing.refund",
		Mode: tasks.ModeOutside,
		Run:  func(context.Context, *tasks.Call, ChargeArgs) (any, error) { return nil, nil },
	})
	fmt.Println("refund refused:", errors.Is(err, tasks.ErrInvalidTask))
	fmt.Println(reg.Names())

	// Then: w, err := tasks.NewWorker(reg, tasks.Config{Broker: ..., Pool: pool}); w.Run(ctx)

	// Output:
	// charge: <nil>
	// credit: <nil>
	// refund refused: true
	// [billing.charge ledger.credit]
}
