package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/onceler/onceler/idempotency"
)

// outside simulates an outside system that takes the operation key as its
// reference (like a payment provider's idempotency key).
type outside struct {
	e   *env
	tbl string
}

func newOutside(t *testing.T, e *env) *outside {
	t.Helper()
	tbl := e.schema + ".outside"
	if _, err := e.pool.Exec(context.Background(), `CREATE TABLE `+tbl+` (ref text NOT NULL, n serial)`); err != nil {
		t.Fatal(err)
	}
	return &outside{e: e, tbl: tbl}
}

func (o *outside) do(t *testing.T, ref string) {
	t.Helper()
	if _, err := o.e.pool.Exec(context.Background(), `INSERT INTO `+o.tbl+` (ref) VALUES ($1)`, ref); err != nil {
		t.Fatal(err)
	}
}

func (o *outside) times(t *testing.T, ref string) int {
	t.Helper()
	return o.e.count(t, `SELECT count(*) FROM `+o.tbl+` WHERE ref = $1`, ref)
}

func (o *outside) lookup(ctx context.Context, key string) ([]byte, bool, error) {
	var n int
	err := o.e.pool.QueryRow(ctx, `SELECT count(*) FROM `+o.tbl+` WHERE ref = $1`, key).Scan(&n)
	if err != nil {
		return nil, false, err
	}
	if n == 0 {
		return nil, false, nil
	}
	return []byte(fmt.Sprintf(`{"found":%d}`, n)), true, nil
}

// TestCrashPolicies simulates a worker crash after the claim (the effect did
// not happen) and after the effect (it happened, completion lost), then a
// redelivery that finds the stale claim and applies each policy.
func TestCrashPolicies(t *testing.T) {
	t.Parallel()
	failingLookup := func(context.Context, string) ([]byte, bool, error) {
		return nil, false, errors.New("provider down")
	}
	cases := []struct {
		name        string
		policy      idempotency.StalePolicy
		failLookup  bool
		afterEffect bool
		want        idempotency.Outcome
		status      idempotency.Status // after the redelivery finishes
		effects     int
		counter     func(idempotency.RepeatStats) int64
	}{
		{"lookup/after-claim", idempotency.StalePolicy{Policy: idempotency.PolicyLookup}, false, false, idempotency.OutcomeFirst, idempotency.StatusCompleted, 1, takeovers},
		{"lookup/after-effect", idempotency.StalePolicy{Policy: idempotency.PolicyLookup}, false, true, idempotency.OutcomeCompleted, idempotency.StatusCompleted, 1, takeovers},
		{"lookup-error/fallback-retry", idempotency.StalePolicy{Policy: idempotency.PolicyLookup, Fallback: idempotency.PolicyRetry}, true, true, idempotency.OutcomeFirst, idempotency.StatusCompleted, 2, takeovers},
		{"lookup-error/fallback-skip", idempotency.StalePolicy{Policy: idempotency.PolicyLookup, Fallback: idempotency.PolicySkip}, true, false, idempotency.OutcomeSkipped, idempotency.StatusSkipped, 0, skipped},
		{"lookup-error/fallback-hold", idempotency.StalePolicy{Policy: idempotency.PolicyLookup, Fallback: idempotency.PolicyHold}, true, true, idempotency.OutcomeHeld, idempotency.StatusHeld, 1, held},
		{"retry/after-claim", idempotency.StalePolicy{Policy: idempotency.PolicyRetry}, false, false, idempotency.OutcomeFirst, idempotency.StatusCompleted, 1, takeovers},
		{"retry/after-effect", idempotency.StalePolicy{Policy: idempotency.PolicyRetry}, false, true, idempotency.OutcomeFirst, idempotency.StatusCompleted, 2, takeovers},
		{"skip/after-claim", idempotency.StalePolicy{Policy: idempotency.PolicySkip}, false, false, idempotency.OutcomeSkipped, idempotency.StatusSkipped, 0, skipped},
		{"skip/after-effect", idempotency.StalePolicy{Policy: idempotency.PolicySkip}, false, true, idempotency.OutcomeSkipped, idempotency.StatusSkipped, 1, skipped},
		{"hold/after-claim", idempotency.StalePolicy{Policy: idempotency.PolicyHold}, false, false, idempotency.OutcomeHeld, idempotency.StatusHeld, 0, held},
		{"hold/after-effect", idempotency.StalePolicy{Policy: idempotency.PolicyHold}, false, true, idempotency.OutcomeHeld, idempotency.StatusHeld, 1, held},
	}
	e := newEnv(t, idempotency.BatchConfig{})
	out := newOutside(t, e)
	ctx := context.Background()
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			task := fmt.Sprintf("charge%d", i)
			p := params(task, "order-7")
			// First delivery: claims, maybe does the effect, then crashes.
			c := mustClaim(t, e.store, p, idempotency.OutcomeFirst)
			if tc.afterEffect {
				out.do(t, task+"/"+p.Key)
			}
			e.expire(t, task, p.Key)

			// Redelivery.
			p.TaskID, p.Owner = "tid-redelivered", "node2"
			p.Message = []byte("redelivered message")
			st := mustClaim(t, e.store, p, idempotency.OutcomeStale)
			if st.Token != c.Token {
				t.Fatalf("stale token")
			}
			sp := tc.policy
			sp.Lookup = func(ctx context.Context, key string) ([]byte, bool, error) {
				return out.lookup(ctx, task+"/"+key)
			}
			if tc.failLookup {
				sp.Lookup = failingLookup
			}
			got, err := e.store.ApplyPolicy(ctx, p, st, sp)
			if err != nil {
				t.Fatal(err)
			}
			if got.Outcome != tc.want {
				t.Fatalf("outcome %v, want %v (%+v)", got.Outcome, tc.want, got)
			}
			if got.Outcome == idempotency.OutcomeFirst {
				// The redelivery runs the task and completes.
				out.do(t, task+"/"+p.Key)
				if _, err := e.store.Complete(ctx, p.Ref(got.Token), []byte(`"done"`)); err != nil {
					t.Fatal(err)
				}
			}
			// The crashed owner cannot complete whatever happened.
			if _, err := e.store.Complete(ctx, p.Ref(c.Token), nil); !errors.Is(err, idempotency.ErrFenced) {
				t.Fatalf("crashed owner complete: %v", err)
			}
			r := e.get(t, task, p.Key)
			if r.Status != tc.status {
				t.Fatalf("status %v, want %v", r.Status, tc.status)
			}
			if n := out.times(t, task+"/"+p.Key); n != tc.effects {
				t.Fatalf("%d effects, want %d", n, tc.effects)
			}
			if tc.status == idempotency.StatusHeld && string(r.Message) != "redelivered message" {
				t.Fatalf("held message %q", r.Message)
			}
			if tc.want == idempotency.OutcomeCompleted && string(r.Result) != `{"found": 1}` {
				t.Fatalf("lookup result %q", r.Result)
			}
			if n := tc.counter(repeatsFor(t, e, task)); n != 1 {
				t.Fatalf("counter %d, want 1", n)
			}
			// A later delivery sees the final state.
			want := map[idempotency.Status]idempotency.Outcome{
				idempotency.StatusCompleted: idempotency.OutcomeCompleted,
				idempotency.StatusHeld:      idempotency.OutcomeHeld,
				idempotency.StatusSkipped:   idempotency.OutcomeSkipped,
			}[tc.status]
			mustClaim(t, e.store, p, want)
		})
	}
}

func takeovers(s idempotency.RepeatStats) int64 { return s.Takeovers }
func skipped(s idempotency.RepeatStats) int64   { return s.Skipped }
func held(s idempotency.RepeatStats) int64      { return s.Held }

func TestApplyPolicyRaceTwoRedeliveries(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{})
	ctx := context.Background()
	p := params("charge", "k")
	mustClaim(t, e.store, p, idempotency.OutcomeFirst)
	e.expire(t, "charge", "k")
	a := mustClaim(t, e.store, p, idempotency.OutcomeStale)
	b := mustClaim(t, e.store, p, idempotency.OutcomeStale)
	// One redelivery retries (takes over), the other then tries to skip.
	ra, err := e.store.ApplyPolicy(ctx, p, a, idempotency.StalePolicy{Policy: idempotency.PolicyRetry})
	if err != nil || ra.Outcome != idempotency.OutcomeFirst {
		t.Fatalf("retry %+v %v", ra, err)
	}
	rb, err := e.store.ApplyPolicy(ctx, p, b, idempotency.StalePolicy{Policy: idempotency.PolicySkip})
	if err != nil || rb.Outcome != idempotency.OutcomeInProgress {
		t.Fatalf("skip after takeover %+v %v", rb, err)
	}
	if r := e.get(t, "charge", "k"); r.Status != idempotency.StatusClaimed || r.Token != ra.Token {
		t.Fatalf("record %+v", r)
	}
}
