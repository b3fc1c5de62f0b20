package idempotency_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
)

// proxiedStore returns a migrated store in a fresh schema whose pool's
// connections pass through a CutProxy.
func proxiedStore(t *testing.T, disabled bool) (*idempotency.Store, *testenv.CutProxy) {
	t.Helper()
	pool, proxy := testenv.ProxiedPool(t)
	schema := testenv.Schema(t, testenv.Pool(t))
	s, err := idempotency.New(pool, idempotency.Config{Schema: schema, Batch: idempotency.BatchConfig{Disabled: disabled}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	if err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return s, proxy
}

func TestUnknownOutcomeIsReportedNotGuessed(t *testing.T) {
	for _, disabled := range []bool{false, true} {
		s, proxy := proxiedStore(t, disabled)
		ctx := context.Background()

		// Completion: the connection drops after the write reached the server.
		p := params("pay", "k")
		c := mustClaim(t, s, p, idempotency.OutcomeFirst)
		proxy.Arm(string(c.Token))
		_, err := s.Complete(ctx, p.Ref(c.Token), []byte(`"paid"`))
		if !idempotency.IsUnknownOutcome(err) || idempotency.IsRetryable(err) {
			t.Fatalf("batched=%v: complete over a cut connection: %v, want unknown outcome", !disabled, err)
		}
		// It did commit; completing again with the same token is a no-op.
		if _, err := s.Complete(ctx, p.Ref(c.Token), []byte(`"paid"`)); err != nil {
			t.Fatalf("complete again: %v", err)
		}
		if r, err := s.Get(ctx, "pay", "k"); err != nil || r.Status != idempotency.StatusCompleted {
			t.Fatalf("record %+v %v", r, err)
		}

		// Same-database run: the connection drops after COMMIT was sent.
		q := params("credit", "k")
		_, err = s.RunTx(ctx, q, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			proxy.Arm("commit")
			return []byte(`1`), nil
		})
		if !idempotency.IsUnknownOutcome(err) {
			t.Fatalf("run tx over a cut connection: %v, want unknown outcome", err)
		}
		// The proxy cut the connection once the server had answered the
		// COMMIT the client lost track of: it is committed.
		if r, err := s.Get(ctx, "credit", "k"); err != nil || r.Status != idempotency.StatusCompleted {
			t.Fatalf("run tx record %+v %v", r, err)
		}
	}
}

// TestUnknownClaimRetriedWithItsToken: a claim whose answer is lost did
// commit. Claimed again with the same token (ClaimParams.Token), it is the
// caller's own claim: first, same attempt, no duplicate counted, even once
// its lease has lapsed. Claimed again with a new token, the caller would
// find its own claim in progress, and stale once the lease lapsed (what a
// retrying caller saw before the token was kept). The same holds for a
// takeover whose answer is lost.
func TestUnknownClaimRetriedWithItsToken(t *testing.T) {
	for _, disabled := range []bool{false, true} {
		t.Run(fmt.Sprintf("batched=%v", !disabled), func(t *testing.T) {
			s, proxy := proxiedStore(t, disabled)
			ctx := context.Background()
			// lostClaim claims key over a connection cut once the server
			// had answered the claim: it is committed, its answer lost.
			lostClaim := func(key string) idempotency.ClaimParams {
				p := params("mail", key)
				p.Lease = 300 * time.Millisecond
				p.Token = idempotency.NewToken()
				proxy.Arm(string(p.Token))
				if _, err := s.Claim(ctx, p); !idempotency.IsUnknownOutcome(err) {
					t.Fatalf("claim over a cut connection: %v, want unknown outcome", err)
				}
				if r, err := s.Get(ctx, "mail", key); err != nil || r.Status != idempotency.StatusClaimed || r.Token != p.Token {
					t.Fatalf("lost claim of %s: record %+v %v, want claimed with its token", key, r, err)
				}
				return p
			}

			p := lostClaim("same-token")
			c := mustClaim(t, s, p, idempotency.OutcomeFirst)
			if c.Token != p.Token || c.Attempt != 1 {
				t.Fatalf("claim again with its token: %+v, want token %s, attempt 1", c, p.Token)
			}
			time.Sleep(2 * p.Lease) // lapsed: still its own
			c = mustClaim(t, s, p, idempotency.OutcomeFirst)
			if _, err := s.Complete(ctx, p.Ref(c.Token), []byte(`"sent"`)); err != nil {
				t.Fatalf("complete: %v", err)
			}
			r, err := s.Get(ctx, "mail", "same-token")
			if err != nil || r.Status != idempotency.StatusCompleted || r.Attempt != 1 || r.Duplicates != 0 {
				t.Fatalf("record %+v %v, want completed, attempt 1, no duplicate", r, err)
			}

			q := lostClaim("new-token")
			q.Token = ""
			mustClaim(t, s, q, idempotency.OutcomeInProgress)
			time.Sleep(2 * q.Lease)
			stale := mustClaim(t, s, q, idempotency.OutcomeStale)

			// A takeover (policy retry) whose answer is lost: the same
			// token finds it, under the attempt it took.
			q.Token = idempotency.NewToken()
			proxy.Arm(string(q.Token))
			if _, err := s.ApplyPolicy(ctx, q, stale, idempotency.StalePolicy{Policy: idempotency.PolicyRetry}); !idempotency.IsUnknownOutcome(err) {
				t.Fatalf("takeover over a cut connection: %v, want unknown outcome", err)
			}
			c = mustClaim(t, s, q, idempotency.OutcomeFirst)
			if c.Token != q.Token || c.Attempt != 2 {
				t.Fatalf("claim again after a lost takeover: %+v, want token %s, attempt 2", c, q.Token)
			}
			if proxy.Lost() != 3 {
				t.Fatalf("%d claims committed with their answers lost, want 3", proxy.Lost())
			}
		})
	}
}

func TestIsRetryable(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{Disabled: true})
	_, err := e.pool.Exec(context.Background(), `DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = '40001'; END $$`)
	if !idempotency.IsRetryable(err) {
		t.Fatalf("serialization failure not retryable: %v", err)
	}
	_, err = e.pool.Exec(context.Background(), `SELECT 1/0`)
	if idempotency.IsRetryable(err) || idempotency.IsRetryable(nil) || idempotency.IsRetryable(idempotency.ErrFenced) {
		t.Fatal("permanent errors reported retryable")
	}
	// Errors a task builds by hand: a connection exception class is
	// retryable; a PostgreSQL error without a code is not (and no panic).
	if !idempotency.IsRetryable(fmt.Errorf("wrapped: %w", &pgconn.PgError{Code: "08006"})) {
		t.Error("connection failure (08006) not retryable")
	}
	if idempotency.IsRetryable(&pgconn.PgError{Message: "no code"}) {
		t.Error("a PostgreSQL error without a code reported retryable")
	}
}
