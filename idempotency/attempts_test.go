package idempotency_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/idempotency"
)

// TestCountAttempt: attempts are counted per operation, each in a committed
// statement of its own (a rolled-back same-database run does not undo
// them), concurrent counts all count, the record is untouched, and Purge
// deletes old counts.
func TestCountAttempt(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{Disabled: true})
	ctx := context.Background()
	for want := 1; want <= 3; want++ {
		n, err := e.store.CountAttempt(ctx, "t", "k")
		if err != nil || n != want {
			t.Fatalf("CountAttempt = %d, %v; want %d", n, err, want)
		}
	}
	if n, err := e.store.CountAttempt(ctx, "t", "other"); err != nil || n != 1 {
		t.Fatalf("another key: %d, %v; want 1", n, err)
	}
	if n, err := e.store.CountAttempt(ctx, "u", "k"); err != nil || n != 1 {
		t.Fatalf("another task: %d, %v; want 1", n, err)
	}

	// A same-database run that fails rolls its claim back; the count stays.
	_, err := e.store.RunTx(ctx, params("t", "k"), func(ctx context.Context, _ pgx.Tx) ([]byte, error) {
		return nil, context.Canceled
	})
	if err == nil {
		t.Fatal("RunTx with a failing fn succeeded")
	}
	if _, err := e.store.Get(ctx, "t", "k"); !errors.Is(err, idempotency.ErrNotFound) {
		t.Fatalf("record after a rolled-back run: %v, want ErrNotFound", err)
	}
	if n, err := e.store.CountAttempt(ctx, "t", "k"); err != nil || n != 4 {
		t.Fatalf("after a rolled-back run: %d, %v; want 4", n, err)
	}

	var wg sync.WaitGroup
	const workers = 8
	for range workers {
		wg.Go(func() {
			if _, err := e.store.CountAttempt(ctx, "t", "c"); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if n, err := e.store.CountAttempt(ctx, "t", "c"); err != nil || n != workers+1 {
		t.Fatalf("after %d concurrent counts: %d, %v", workers, n, err)
	}

	if _, err := e.store.Purge(ctx, idempotency.PurgeParams{Before: time.Now().Add(-time.Hour)}); err != nil {
		t.Fatal(err)
	}
	if n, _ := e.store.CountAttempt(ctx, "u", "k"); n != 2 {
		t.Fatalf("a recent count was purged: %d, want 2", n)
	}
	if _, err := e.store.Purge(ctx, idempotency.PurgeParams{Before: time.Now().Add(time.Hour)}); err != nil {
		t.Fatal(err)
	}
	if n, err := e.store.CountAttempt(ctx, "t", "k"); err != nil || n != 1 {
		t.Fatalf("after purging old counts: %d, %v; want 1", n, err)
	}
}
