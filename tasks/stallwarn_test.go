package tasks

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

func outsideRegistry(t *testing.T) *Registry {
	t.Helper()
	reg := NewRegistry()
	err := Register(reg, Task[payArgs]{Name: "t.stall_pay", Mode: ModeOutside,
		Key: func(a payArgs) (string, error) { return a.OrderID, nil },
		Run: func(context.Context, *Call, payArgs) (any, error) { return "paid", nil }})
	if err != nil {
		t.Fatal(err)
	}
	return reg
}

// A worker on a record schema that was never migrated, or lacks a migration,
// returns from Run at once with an error naming the schema and the command
// that applies it, instead of holding deliveries it can never claim.
func TestRunRefusesMissingOrOldSchema(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	pool := testenv.Pool(t)
	empty := testenv.Schema(t, pool)
	store, err := idempotency.New(pool, idempotency.Config{Schema: empty})
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	run := func(s *idempotency.Store) error {
		cfg := e.config()
		cfg.Store = s
		w, err := NewWorker(outsideRegistry(t), cfg)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		start := time.Now()
		err = w.Run(ctx)
		if time.Since(start) > 10*time.Second || ctx.Err() != nil {
			t.Fatalf("Run took %v: it should refuse at start", time.Since(start))
		}
		return err
	}
	err = run(store)
	var se *idempotency.SchemaError
	if !errors.As(err, &se) || se.Have != 0 || !errors.Is(err, idempotency.ErrSchemaNotCurrent) {
		t.Fatalf("Run on an empty schema: %v, want a SchemaError for a missing schema", err)
	}
	for _, want := range []string{`"` + empty + `" does not exist`, "onceler migrate --schema " + empty, "--migrate"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}

	// One migration short of the binary's.
	if _, err := pool.Exec(context.Background(), `DELETE FROM "`+e.schema+`".migrations WHERE version = (SELECT max(version) FROM "`+e.schema+`".migrations)`); err != nil {
		t.Fatal(err)
	}
	err = run(e.store)
	if !errors.As(err, &se) || se.Have == 0 || se.Have >= se.Want || !strings.Contains(err.Error(), "older than this binary") {
		t.Fatalf("Run on an old schema: %v, want a SchemaError for an old schema", err)
	}
}

// A delivery whose operation is claimed elsewhere waits for that claim; once
// it has waited longer than a lease, the worker says so, with the claim's
// lease end, and says it once per lease, not at every look.
func TestWarnsWhenClaimHeldElsewhere(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	held, err := e.store.Claim(ctx, idempotency.ClaimParams{Task: "t.stall_pay", Key: "order-held", Owner: "elsewhere",
		TaskID: "other", Lease: 10 * time.Minute})
	if err != nil || held.Outcome != idempotency.OutcomeFirst {
		t.Fatalf("claim elsewhere: %+v, %v", held, err)
	}
	core, logs := observer.New(zap.WarnLevel)
	cfg := e.config()
	cfg.Lease = 2 * time.Second
	cfg.Logger = zap.New(core)
	e.start(outsideRegistry(t), cfg)
	sent := time.Now()
	e.publish(&celeryproto.Message{ID: taskID(1), Task: "t.stall_pay", Kwargs: map[string]any{"order_id": "order-held", "amount": 5}})

	const msg = "operation claimed by another delivery still in progress"
	testkit.WaitFor(t, "the stall warning", cfg.Lease+2*time.Second, func() bool {
		return logs.FilterMessageSnippet(msg).Len() > 0
	})
	if waited := time.Since(sent); waited < cfg.Lease {
		t.Errorf("warned after %v, before a lease (%v) had passed", waited, cfg.Lease)
	}
	entry := logs.FilterMessageSnippet(msg).All()[0]
	fields := entry.ContextMap()
	if fields["reason"] != "claim in progress elsewhere" {
		t.Errorf("reason %v", fields["reason"])
	}
	if lu, ok := fields["lease_until"].(time.Time); !ok || !lu.Equal(held.LeaseUntil) {
		t.Errorf("lease_until %v, want the claim's %v", fields["lease_until"], held.LeaseUntil)
	}
	time.Sleep(cfg.Lease * 3 / 4)
	if n := logs.FilterMessageSnippet(msg).Len(); n != 1 {
		t.Errorf("%d warnings within one lease, want 1", n)
	}
	if e.queueDepth(e.queue) != 0 {
		t.Errorf("the delivery is not held by the worker")
	}
}
