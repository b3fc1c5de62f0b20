package idempotency_test

import (
	"context"
	"testing"
	"time"

	"github.com/onceler/onceler/idempotency"
)

// By default a call queued behind a small flush that cannot commit (here
// one waiting for a row lock) goes out in a second flush of its own; with
// Flushers 1 it waits for the first flush.
func TestSecondFlushBehindASmallOne(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		flushers int
		second   bool
	}{{0, true}, {1, false}} {
		e := newEnv(t, idempotency.BatchConfig{Flushers: tc.flushers})
		ctx := context.Background()
		p := params("flush", "locked")
		c := mustClaim(t, e.store, p, idempotency.OutcomeFirst)
		if _, err := e.store.Complete(ctx, p.Ref(c.Token), []byte(`1`)); err != nil {
			t.Fatal(err)
		}
		tx, err := e.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, `SELECT 1 FROM `+e.schema+`.records WHERE task = 'flush' AND key = 'locked' FOR UPDATE`); err != nil {
			t.Fatal(err)
		}
		blocked := make(chan idempotency.Claim, 1)
		go func() {
			c, err := e.store.Claim(ctx, p) // a duplicate: its count waits for the lock
			if err != nil {
				t.Error(err)
			}
			blocked <- c
		}()
		time.Sleep(200 * time.Millisecond) // its flush is running, blocked
		free := make(chan error, 1)
		go func() {
			_, err := e.store.Claim(ctx, params("flush", "free"))
			free <- err
		}()
		select {
		case err := <-free:
			if err != nil {
				t.Fatal(err)
			}
			if !tc.second {
				t.Errorf("flushers %d: a call went out while the flush ahead of it waited", tc.flushers)
			}
		case <-time.After(2 * time.Second):
			if tc.second {
				t.Errorf("flushers %d: the call behind a blocked flush of one call waited for it", tc.flushers)
			}
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		if c := <-blocked; c.Outcome != idempotency.OutcomeCompleted {
			t.Errorf("blocked claim: %+v", c)
		}
		if !tc.second {
			if err := <-free; err != nil {
				t.Fatal(err)
			}
		}
	}
}
