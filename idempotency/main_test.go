package idempotency_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"
	"go.uber.org/zap/zaptest"

	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

type env struct {
	pool   *pgxpool.Pool
	schema string
	store  *idempotency.Store
}

// newEnv returns a migrated store in a fresh schema of its own.
func newEnv(tb testing.TB, batch idempotency.BatchConfig) *env {
	tb.Helper()
	pool := testenv.Pool(tb)
	schema := testenv.Schema(tb, pool)
	var cfg idempotency.Config
	cfg.Schema, cfg.Batch = schema, batch
	if t, ok := tb.(*testing.T); ok {
		cfg.Logger = zaptest.NewLogger(t)
	}
	s, err := idempotency.New(pool, cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(s.Close)
	if err := s.Migrate(context.Background()); err != nil {
		tb.Fatal(err)
	}
	return &env{pool: pool, schema: schema, store: s}
}

// both runs f with batching on and off.
func both(t *testing.T, f func(t *testing.T, e *env)) {
	t.Helper()
	for _, disabled := range []bool{false, true} {
		t.Run(fmt.Sprintf("batched=%v", !disabled), func(t *testing.T) {
			f(t, newEnv(t, idempotency.BatchConfig{Disabled: disabled}))
		})
	}
}

// expire makes the lease of (task, key) lapse, as if time passed.
func (e *env) expire(t *testing.T, task, key string) {
	t.Helper()
	_, err := e.pool.Exec(context.Background(),
		`UPDATE `+e.schema+`.records SET lease_until = now() - interval '1 second' WHERE task = $1 AND key = $2`, task, key)
	if err != nil {
		t.Fatal(err)
	}
}

func (e *env) get(t *testing.T, task, key string) idempotency.Record {
	t.Helper()
	r, err := e.store.Get(context.Background(), task, key)
	if err != nil {
		t.Fatalf("get %s/%s: %v", task, key, err)
	}
	return r
}

func params(task, key string) idempotency.ClaimParams {
	return idempotency.ClaimParams{
		Task: task, Key: key, Fingerprint: []byte("fp-" + key), Owner: "node1",
		TaskID: "tid-" + key, Lease: time.Minute, Message: []byte(`{"msg":"` + key + `"}`),
	}
}

func mustClaim(t *testing.T, s *idempotency.Store, p idempotency.ClaimParams, want idempotency.Outcome) idempotency.Claim {
	t.Helper()
	c, err := s.Claim(context.Background(), p)
	if err != nil {
		t.Fatalf("claim %s: %v", p.Key, err)
	}
	if c.Outcome != want {
		t.Fatalf("claim %s: outcome %v, want %v (%+v)", p.Key, c.Outcome, want, c)
	}
	return c
}
