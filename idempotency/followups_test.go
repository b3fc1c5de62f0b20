package idempotency_test

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/onceler/onceler/idempotency"
)

// TestFollowups: the ids of published workflow steps are recorded once per
// completed operation, read back in order, and refused for an operation
// that is not completed.
func TestFollowups(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{Disabled: true})
	ctx := context.Background()
	if _, err := e.store.Followups(ctx, "t", "none"); !errors.Is(err, idempotency.ErrNotFound) {
		t.Fatalf("Followups of a missing record: %v", err)
	}
	p := params("t", "k")
	c := mustClaim(t, e.store, p, idempotency.OutcomeFirst)
	if err := e.store.AddFollowups(ctx, "t", "k", []string{"a"}); !errors.Is(err, idempotency.ErrNotFound) {
		t.Fatalf("AddFollowups on a claimed record: %v", err)
	}
	if _, err := e.store.Complete(ctx, p.Ref(c.Token), []byte(`1`)); err != nil {
		t.Fatal(err)
	}
	ids, err := e.store.Followups(ctx, "t", "k")
	if err != nil || len(ids) != 0 {
		t.Fatalf("Followups after completion = %v, %v", ids, err)
	}
	if err := e.store.AddFollowups(ctx, "t", "k", []string{"b", "a", "b"}); err != nil {
		t.Fatal(err)
	}
	if err := e.store.AddFollowups(ctx, "t", "k", []string{"a", "c"}); err != nil {
		t.Fatal(err)
	}
	if err := e.store.AddFollowups(ctx, "t", "k", nil); err != nil {
		t.Fatal(err)
	}
	ids, err = e.store.Followups(ctx, "t", "k")
	if err != nil || !slices.Equal(ids, []string{"a", "b", "c"}) {
		t.Fatalf("Followups = %v, %v; want [a b c]", ids, err)
	}
	// A duplicate claim of the completed operation leaves them alone.
	mustClaim(t, e.store, p, idempotency.OutcomeCompleted)
	if ids, _ := e.store.Followups(ctx, "t", "k"); len(ids) != 3 {
		t.Fatalf("after a duplicate: %v", ids)
	}
}
