package idempotency_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/onceler/onceler/idempotency"
)

// forget deletes the record of (task, key), as a failover to a server the
// claim never reached does.
func (e *env) forget(t *testing.T, task, key string) {
	t.Helper()
	if _, err := e.pool.Exec(context.Background(), `DELETE FROM `+e.schema+`.records WHERE task = $1 AND key = $2`, task, key); err != nil {
		t.Fatal(err)
	}
}

// TestRewriteOfAForgottenClaim: a final write that finds no record
// (ErrNotFound) is written anew by Rewrite in its final state, once (a
// repeat is a no-op), counted as the write it replaces; a record claimed by
// another delivery in between is ErrFenced and left as it is.
func TestRewriteOfAForgottenClaim(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{Disabled: true})
	ctx := context.Background()
	for _, tc := range []struct {
		key  string
		st   idempotency.Rewritten
		kind func(idempotency.RepeatStats) int64
	}{
		{"done", idempotency.Rewritten{Status: idempotency.StatusCompleted, Result: []byte(`[1,2]`)}, nil},
		{"failed", idempotency.Rewritten{Status: idempotency.StatusFailed, Error: "boom"}, func(r idempotency.RepeatStats) int64 { return r.Failures }},
		{"held", idempotency.Rewritten{Status: idempotency.StatusHeld, Message: []byte(`{"m":1}`), Reason: "why"}, func(r idempotency.RepeatStats) int64 { return r.Held }},
		{"skipped", idempotency.Rewritten{Status: idempotency.StatusSkipped, Reason: "why"}, func(r idempotency.RepeatStats) int64 { return r.Skipped }},
	} {
		task := "rw." + tc.key
		p := params(task, tc.key)
		c := mustClaim(t, e.store, p, idempotency.OutcomeFirst)
		e.forget(t, task, tc.key)
		if _, err := e.store.Complete(ctx, p.Ref(c.Token), []byte(`1`)); !errors.Is(err, idempotency.ErrNotFound) {
			t.Fatalf("%s: complete of a forgotten claim: %v, want ErrNotFound", tc.key, err)
		}
		for i := 0; i < 2; i++ {
			if err := e.store.Rewrite(ctx, p.Ref(c.Token), tc.st); err != nil {
				t.Fatalf("%s: rewrite %d: %v", tc.key, i, err)
			}
		}
		r := e.get(t, task, tc.key)
		if r.Status != tc.st.Status || (tc.st.Message != nil && string(r.Message) != string(tc.st.Message)) ||
			(tc.st.Result != nil && string(r.Result) != "[1, 2]") {
			t.Errorf("%s: record %+v, want %+v", tc.key, r, tc.st)
		}
		if tc.kind != nil {
			if n := tc.kind(repeatsFor(t, e, task)); n != 1 {
				t.Errorf("%s: counted %d times, want 1", tc.key, n)
			}
		}
	}
	// Claimed by another delivery in between: fenced, the record untouched.
	p := params("rw.other", "k")
	c := mustClaim(t, e.store, p, idempotency.OutcomeFirst)
	e.forget(t, "rw.other", "k")
	other := mustClaim(t, e.store, p, idempotency.OutcomeFirst)
	err := e.store.Rewrite(ctx, p.Ref(c.Token), idempotency.Rewritten{Status: idempotency.StatusCompleted, Result: []byte(`1`)})
	if !errors.Is(err, idempotency.ErrFenced) {
		t.Errorf("rewrite over another delivery's claim: %v, want ErrFenced", err)
	}
	if r := e.get(t, "rw.other", "k"); r.Status != idempotency.StatusClaimed || r.Token != other.Token {
		t.Errorf("record %s token %s, want the other delivery's claim %s", r.Status, r.Token, other.Token)
	}
}

// TestRenewWritesAForgottenClaimAnew: a renewal that finds no record writes
// the claim anew with its token; one that finds another delivery's claim
// is fenced.
func TestRenewWritesAForgottenClaimAnew(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{Disabled: true})
	ctx := context.Background()
	p := params("rn.task", "k")
	c := mustClaim(t, e.store, p, idempotency.OutcomeFirst)
	e.forget(t, p.Task, p.Key)
	if err := e.store.Renew(ctx, p.Ref(c.Token), time.Minute); err != nil {
		t.Fatalf("renew of a forgotten claim: %v", err)
	}
	if r := e.get(t, p.Task, p.Key); r.Status != idempotency.StatusClaimed || r.Token != c.Token || !r.Live {
		t.Fatalf("record %+v, want claimed anew with the token, live", r)
	}
	if _, err := e.store.Complete(ctx, p.Ref(c.Token), []byte(`1`)); err != nil {
		t.Fatalf("complete after the renewal: %v", err)
	}
	e.forget(t, p.Task, p.Key)
	mustClaim(t, e.store, p, idempotency.OutcomeFirst)
	if err := e.store.Renew(ctx, p.Ref(c.Token), time.Minute); !errors.Is(err, idempotency.ErrFenced) {
		t.Errorf("renew over another delivery's claim: %v, want ErrFenced", err)
	}
}
