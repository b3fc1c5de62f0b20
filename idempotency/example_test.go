package idempotency_test

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
)

// exampleStore opens a store in a fresh schema; it returns a cleanup func.
func exampleStore() (*idempotency.Store, func(), error) {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.DefaultDatabaseURL)
	if err != nil {
		return nil, nil, err
	}
	schema := testenv.Name("example")
	s, err := idempotency.New(pool, idempotency.Config{Schema: schema})
	if err != nil {
		pool.Close()
		return nil, nil, err
	}
	cleanup := func() {
		s.Close()
		_, _ = pool.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE")
		pool.Close()
	}
	if err := s.Migrate(ctx); err != nil {
		cleanup()
		return nil, nil, err
	}
	return s, cleanup, nil
}

// An outside-system task: claim, run with a heartbeat, complete. A second
// delivery of the same operation gets the stored result.
func Example() {
	s, cleanup, err := exampleStore()
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cleanup()
	ctx := context.Background()

	p := idempotency.ClaimParams{
		Task: "payments.charge", Key: "order-42", Fingerprint: []byte("sha256 of the args"),
		Owner: "worker@host", TaskID: "3f1c...", Lease: 30 * time.Second,
	}
	c, err := s.Claim(ctx, p)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("first delivery:", c.Outcome)

	runCtx, stop := s.Keep(ctx, p.Ref(c.Token), p.Lease)
	_ = runCtx // charge the card with "order-42" as the provider's idempotency key
	stop()
	if _, err := s.Complete(ctx, p.Ref(c.Token), []byte(`{"charge":"ch_1"}`)); err != nil {
		fmt.Println(err)
		return
	}

	dup, err := s.Claim(ctx, p)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("redelivery:", dup.Outcome, string(dup.Result))
	// Output:
	// first delivery: first
	// redelivery: completed {"charge": "ch_1"}
}

// A same-database task: the effect and the record commit together.
func ExampleStore_RunTx() {
	s, cleanup, err := exampleStore()
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cleanup()
	ctx := context.Background()
	p := idempotency.ClaimParams{Task: "ledger.credit", Key: "transfer-7"}
	credit := func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		// tx.Exec(ctx, "UPDATE accounts SET balance = balance + 10 WHERE id = 1")
		return []byte(`10`), nil
	}
	for range 2 {
		c, err := s.RunTx(ctx, p, credit)
		if err != nil {
			fmt.Println(err)
			return
		}
		fmt.Println(c.Outcome, c.Status, string(c.Result))
	}
	// Output:
	// first completed 10
	// completed completed 10
}
