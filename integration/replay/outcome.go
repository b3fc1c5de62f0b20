package replay

import (
	"context"
	"slices"
	"time"

	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testkit"
	"github.com/onceler/onceler/tasks"
)

// check waits for the outcome and asserts it.
func (r *runner) check() {
	t := r.t
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	want := r.expect()
	if r.tg.NoRecord {
		want = Expectation{Answered: true, ExcType: r.tg.Exception}
	}
	var ids []string
	for _, op := range r.ops {
		ids = append(ids, r.calls[op]...)
	}
	timeout := 60*time.Second + 4*r.e.cfg.Lease
	if want.Answered {
		if !r.e.WaitReplies(ids, r.sends, timeout) {
			t.Errorf("not every caller got a result within %s", timeout)
		}
	} else {
		// No caller gets a result: wait for the record's final status, and
		// for a re-sent delivery to find it.
		testkit.Eventually(timeout, func() bool { return r.statusIs(ctx, want.Status) })
		time.Sleep(r.e.cfg.Lease + 3*time.Second)
	}
	if want.Status == idempotency.StatusHeld && !r.tg.NoRecord {
		defer r.resolveHeld(ctx, want)
	}
	if r.tg.Effects != nil && want.Answered {
		// A duplicate that answers from the record may answer before a
		// still-running copy ends (no record); let effects settle.
		time.Sleep(500 * time.Millisecond)
	}
	r.e.StopAll()

	// Results.
	for _, op := range r.ops {
		for _, id := range r.calls[op] {
			reps := r.e.Replies(id)
			if !want.Answered {
				for _, rep := range reps {
					if rep.Status == "SUCCESS" {
						t.Errorf("operation %s task %s: held, yet its caller got SUCCESS", op, id)
					}
				}
				continue
			}
			if len(reps) < r.e.repliesPer(r.sends) {
				t.Errorf("operation %s task %s: %d results, want %d (one per delivery)", op, id, len(reps), r.sends)
			}
			for _, rep := range reps {
				wantStatus := "SUCCESS"
				if want.ExcType != "" {
					wantStatus = "FAILURE"
				}
				if rep.Status != wantStatus || rep.ExcType != want.ExcType {
					t.Errorf("operation %s task %s: result %s %s %s, want %s %s", op, id, rep.Status, rep.ExcType,
						rep.Result, wantStatus, want.ExcType)
				}
			}
		}
	}
	// The queue and the quarantine are empty.
	if n, err := r.e.QueueDepth(r.e.Queue); err != nil || n != 0 {
		t.Errorf("queue %s: %d messages left (err %v), want 0", r.e.Queue, n, err)
	}
	if q, err := r.e.TakeQuarantined(); err != nil || len(q) != 0 {
		t.Errorf("quarantine: %v (err %v), want none", q, err)
	}
	// Effects.
	counts := make(map[string]int)
	if r.tg.Effects != nil {
		for _, op := range r.ops {
			n, err := r.tg.Effects(ctx, r.e.Pool, op)
			if err != nil {
				t.Fatalf("count effects of %s: %v", op, err)
			}
			counts[op] = n
		}
	}
	if r.tg.NoRecord {
		r.checkNoRecord(counts)
		return
	}
	for _, op := range r.ops {
		if r.tg.Effects != nil && counts[op] != want.Effects {
			t.Errorf("operation %s: %d effects, want %d (%s, mode %s, policy %s)", op, counts[op], want.Effects,
				r.s, r.tg.Mode, r.tg.Policy)
		}
		if r.tg.Mode != tasks.ModePure {
			rec, err := r.e.Store.Get(ctx, r.tg.Task, r.tg.Key(op))
			if err != nil {
				t.Errorf("operation %s: record: %v", op, err)
			} else if rec.Status != want.Status {
				t.Errorf("operation %s: record %s (%s), want %s", op, rec.Status, rec.Reason, want.Status)
			}
		}
	}
	if want.Takeover {
		n, err := r.e.Takeovers(ctx, r.tg.Task, r.start.Add(-time.Minute))
		if err != nil || n < 1 {
			t.Errorf("takeovers counted: %d (err %v), want at least 1", n, err)
		}
	}
	if n, err := r.e.StaleClaims(ctx); err != nil || n != 0 {
		t.Errorf("stale claims: %d (err %v), want 0", n, err)
	}
}

func (r *runner) statusIs(ctx context.Context, s idempotency.Status) bool {
	for _, op := range r.ops {
		rec, err := r.e.Store.Get(ctx, r.tg.Task, r.tg.Key(op))
		if err != nil || rec.Status != s {
			return false
		}
	}
	return true
}

// checkNoRecord asserts that, without the record, the scenario shows the
// duplicate the record prevents: some operation had its effect again.
func (r *runner) checkNoRecord(counts map[string]int) {
	if r.tg.Effects == nil {
		r.t.Logf("no effects to count: %s only checks results without the record", r.s)
		return
	}
	dup := 0
	for _, op := range r.ops {
		if counts[op] > 1 {
			dup++
		}
	}
	vals := make([]int, 0, len(r.ops))
	for _, op := range r.ops {
		vals = append(vals, counts[op])
	}
	if dup == 0 {
		r.t.Errorf("without the record, %s showed no duplicate effect (effects per operation %v): the scenario does not test what the record prevents",
			r.s, vals)
		return
	}
	r.t.Logf("without the record, as expected: %d of %d operations had their effect more than once (max %d)",
		dup, len(r.ops), slices.Max(vals))
}

// resolveHeld does what a person does with a held operation, once its
// scenario's checks passed: looks at the outside system (the effect count)
// and runs "onceler resolve": --completed when the effect happened, --retry
// (release the record, republish the kept message) when it did not. Then
// the operation has its effect exactly once, the record says completed,
// and the caller of a replayed message gets its result.
func (r *runner) resolveHeld(ctx context.Context, want Expectation) {
	t := r.t
	if t.Failed() || r.tg.Effects == nil {
		return
	}
	for _, op := range r.ops {
		key := r.tg.Key(op)
		rec, err := r.e.Store.Get(ctx, r.tg.Task, key)
		if err != nil {
			t.Fatalf("operation %s: record: %v", op, err)
		}
		n, err := r.tg.Effects(ctx, r.e.Pool, op)
		if err != nil {
			t.Fatalf("count effects of %s: %v", op, err)
		}
		if n > 0 {
			if err := r.e.Store.ResolveCompleted(ctx, r.tg.Task, key, nil); err != nil {
				t.Fatalf("resolve completed: %v", err)
			}
			t.Logf("operation %s held with its effect done: resolved completed", op)
			continue
		}
		exchange, routingKey, p, err := tasks.DecodeHeld(rec.Message)
		if err != nil {
			t.Fatalf("held message of %s: %v", op, err)
		}
		if _, err := r.e.Store.ResolveRetry(ctx, r.tg.Task, key); err != nil {
			t.Fatalf("resolve retry: %v", err)
		}
		before := len(r.e.Replies(p.CorrelationID))
		r.worker(WorkerOptions{})
		if err := r.e.PublishRaw(ctx, exchange, routingKey, p); err != nil {
			t.Fatalf("republish held message: %v", err)
		}
		if !r.e.WaitReplies([]string{p.CorrelationID}, before+1, time.Minute) || !r.e.answeredAgain(p.CorrelationID, time.Minute) {
			t.Errorf("operation %s: the replayed held message got no result", op)
		}
		t.Logf("operation %s held before its effect: resolved retry, replayed, answered %v", op, r.e.Replies(p.CorrelationID))
		r.e.StopAll()
	}
	for _, op := range r.ops {
		n, err := r.tg.Effects(ctx, r.e.Pool, op)
		if err != nil || n != 1 {
			t.Errorf("operation %s after resolving: %d effects (err %v), want 1", op, n, err)
		}
		rec, err := r.e.Store.Get(ctx, r.tg.Task, r.tg.Key(op))
		if err != nil || rec.Status != idempotency.StatusCompleted {
			t.Errorf("operation %s after resolving: record %s (err %v), want completed", op, rec.Status, err)
		}
	}
	if n, err := r.e.QueueDepth(r.e.Queue); err != nil || n != 0 {
		t.Errorf("after resolving: queue %d messages (err %v), want 0", n, err)
	}
}
