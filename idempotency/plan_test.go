package idempotency_test

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/onceler/onceler/idempotency"
)

// TestBatchedCompletionsNeverScan: a flush completes its records in one
// statement that joins arrays with the records. Its plan is cached while
// the table is young (a few rows: a sequential scan is cheapest then) and
// must not scan the table once it has grown: every completion finds its
// record by primary key. The store runs on one connection, whose table
// statistics (sequential scans of the records) are read after it has
// flushed them.
func TestBatchedCompletionsNeverScan(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema, s := ownPoolStore(t, 1, idempotency.BatchConfig{Flushers: 1})
	seqScans := func() int64 {
		t.Helper()
		if _, err := pool.Exec(ctx, `SELECT pg_stat_force_next_flush()`); err != nil {
			t.Fatal(err)
		}
		var n int64
		if err := pool.QueryRow(ctx, `SELECT seq_scan FROM pg_stat_user_tables WHERE relid = $1::regclass`,
			schema+".records").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	run := func(prefix string, callers, each int) {
		t.Helper()
		var wg sync.WaitGroup
		for c := range callers {
			wg.Go(func() {
				for i := range each {
					p := params("plan", fmt.Sprintf("%s-%d-%d", prefix, c, i))
					cl, err := s.Claim(ctx, p)
					if err == nil && cl.Outcome == idempotency.OutcomeFirst {
						_, err = s.Complete(ctx, p.Ref(cl.Token), []byte(`1`))
					}
					if err != nil || cl.Outcome != idempotency.OutcomeFirst {
						t.Errorf("claim+complete %s: %v %v", p.Key, cl.Outcome, err)
						return
					}
				}
			})
		}
		wg.Wait()
	}
	// Young table: the statement's plan is made and cached now.
	run("young", 8, 10)
	if _, err := pool.Exec(ctx, `INSERT INTO `+schema+`.records (task, key, status, token, completed_at)
SELECT 'plan', 'old-' || i, 'completed', 't', now() FROM generate_series(1, 50000) i`); err != nil {
		t.Fatal(err)
	}
	before, start := seqScans(), s.BatchStats()
	run("grown", 8, 20)
	after, end := seqScans(), s.BatchStats()
	if ops, flushes := end.Ops-start.Ops, end.Flushes-start.Flushes; ops < 2*flushes {
		t.Fatalf("%d calls in %d flushes: the flushes carried too few completions to test", ops, flushes)
	}
	if after != before {
		t.Errorf("%d sequential scans of the records during batched completions, want none", after-before)
	}
	r, err := s.Get(ctx, "plan", "grown-7-19")
	if err != nil || r.Status != idempotency.StatusCompleted {
		t.Fatalf("record %+v %v", r, err)
	}
}
