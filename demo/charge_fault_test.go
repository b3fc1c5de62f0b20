package demo

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap/zaptest"

	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/tasks"
)

// A gateway call cut off by a terminated connection is an unknown outcome:
// the charge task's AutoRetry must accept it (so the call is made again
// under the same reference), while an answer from the gateway is final.
func TestChargeRetriesAGatewayCallCutOff(t *testing.T) {
	ctx := context.Background()
	base := testenv.Pool(t)
	if err := Migrate(ctx, base); err != nil {
		t.Fatal(err)
	}
	app := testenv.Name("charge_fault")
	cfg, err := pgxpool.ParseConfig(testenv.DatabaseURL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	d := &demo{pool: pool, log: zaptest.NewLogger(t)}
	order := testenv.Name("order")

	// Hold the reference's row lock so the gateway call waits inside its
	// transaction, then terminate the gateway's backend.
	blocker, err := base.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = blocker.Rollback(ctx) }()
	if _, err := blocker.Exec(ctx, `INSERT INTO onceler_demo.gateway_charges (reference, order_id, cents) VALUES ($1, $2, 1)`,
		ChargeReference(order), order); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := d.charge(ctx, &tasks.Call{TaskID: "t1", Key: order}, ChargeArgs{OrderID: order, Cents: 1})
		done <- err
	}()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var n int
		if err := base.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'`, app).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the gateway call never waited on the lock")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if _, err := base.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1`, app); err != nil {
		t.Fatal(err)
	}
	err = <-done
	if err == nil {
		t.Fatal("charge succeeded on a terminated connection")
	}
	if !tasks.IsConnectionError(err) {
		t.Fatalf("a call cut off by a terminated connection is not retried: %v", err)
	}

	_ = blocker.Rollback(ctx)
	if tasks.IsConnectionError(context.Canceled) {
		t.Fatal("a cancelled call counted as a connection error")
	}
	// The call made again under the same reference charges once.
	if _, err := d.charge(ctx, &tasks.Call{TaskID: "t2", Key: order}, ChargeArgs{OrderID: order, Cents: 1}); err != nil {
		t.Fatalf("charge after the cut: %v", err)
	}
	n, err := CountGatewayCharges(ctx, base, order)
	if err != nil || n != 1 {
		t.Fatalf("charges for the order: %d, %v; want 1", n, err)
	}
}
