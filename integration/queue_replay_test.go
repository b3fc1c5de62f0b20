package integration

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/internal/testkit"
	"github.com/onceler/onceler/internal/workerhooks"
)

// queueRun is one replay scenario of one target through the Sidekiq or
// the SQS harness: its operations and what the transport does.
type queueRun struct {
	t        *testing.T
	e        *queueEnv
	tg       skTarget
	noRecord bool
	prefix   string
	ops      []string
	tr       queueTransport
}

// queueTransport is what a replay scenario needs of a transport's
// harness.
type queueTransport struct {
	// items names what the transport carries ("jobs", "messages") and
	// idleName where they wait ("Redis", "queue"), in failure messages.
	items, idleName string
	// idle reports whether no job or message is left to run.
	idle func() bool
	// startWorker starts a worker with options o (NoRecord set).
	startWorker func(o queueWorkerOptions) *skWorker
	// send sends one job or message for each of ops; same: those of one
	// operation are one job pushed again (Sidekiq: one jid).
	send func(ops []string, same bool)
	// own is the transport's own kill scenario, which own runs (the
	// worker killed while the operation waits unstarted behind a slow
	// task); it is expected as replay.ScenarioRepeated.
	own    replay.Scenario
	runOwn func(r *queueRun)
	// afterKill follows the kill of worker w: another worker, which
	// recovers w's jobs or messages, and the operation sent again (a
	// producer whose call timed out).
	afterKill func(r *queueRun, w *skWorker)
	// setAside fails the test if a job or message was set aside (the
	// dead set, the quarantine queue); it runs once the workers stopped.
	setAside func(t *testing.T)
	// resolveHeld, if not nil, resolves the operations held for a
	// person when the scenario holds them (the SQS targets hold none).
	resolveHeld func(ctx context.Context, r *queueRun)
}

// worker starts a worker with options o and the run's --no-record.
func (r *queueRun) worker(o queueWorkerOptions) *skWorker {
	o.NoRecord = r.noRecord
	return r.tr.startWorker(o)
}

// op is the run's i-th operation id.
func (r *queueRun) op(i int) string { return fmt.Sprintf("%s-%d", r.prefix, i) }

// newOps adds n operations to the run; returns what to send for them,
// sends(i) for the i-th.
func (r *queueRun) newOps(n int, sends func(i int) []string) []string {
	var ops []string
	for i := range n {
		r.ops = append(r.ops, r.op(i))
		ops = append(ops, sends(i)...)
	}
	return ops
}

// queueScenarios are the replay scenarios of a transport: the Celery
// suite's (replay.Scenario) with own, the transport's own kill scenario,
// in place of the kill before the ack.
func queueScenarios(own replay.Scenario) []replay.Scenario {
	return []replay.Scenario{replay.ScenarioRepeated, replay.ScenarioConcurrent, replay.ScenarioCrashAfterClaim,
		replay.ScenarioCrashAfterEffect, own, replay.ScenarioMany}
}

// runQueueReplay runs, in parallel by target, every scenario of
// scenarios with the record and without (--no-record): the subtests
// name/scenario/record and name/scenario/no_record.
func runQueueReplay[T any](t *testing.T, targets []T, name func(T) string, scenarios []replay.Scenario,
	play func(t *testing.T, tg T, s replay.Scenario, noRecord bool)) {
	t.Parallel()
	for _, tg := range targets {
		t.Run(name(tg), func(t *testing.T) {
			t.Parallel()
			for _, s := range scenarios {
				t.Run(string(s), func(t *testing.T) {
					t.Run("record", func(t *testing.T) { play(t, tg, s, false) })
					t.Run("no_record", func(t *testing.T) { play(t, tg, s, true) })
				})
			}
		})
	}
}

// run plays scenario s, then checks its outcome.
func (r *queueRun) run(s replay.Scenario) {
	t := r.t
	start := time.Now()
	switch s {
	case replay.ScenarioRepeated:
		// The same job or message sent three times in a row.
		r.worker(queueWorkerOptions{})
		r.tr.send(r.newOps(3, func(i int) []string { return []string{r.op(i), r.op(i), r.op(i)} }), true)
	case replay.ScenarioConcurrent:
		r.worker(queueWorkerOptions{})
		r.worker(queueWorkerOptions{})
		r.tr.send(r.newOps(5, func(i int) []string { return []string{r.op(i), r.op(i)} }), false)
	case replay.ScenarioCrashAfterClaim, replay.ScenarioCrashAfterEffect:
		at := workerhooks.AfterClaim
		if s == replay.ScenarioCrashAfterEffect {
			at = workerhooks.AfterEffect
		}
		w1 := r.worker(queueWorkerOptions{CrashAt: at, CrashTask: r.tg.task, Concurrency: 1, Prefetch: 1})
		r.ops = []string{r.op(0)}
		r.tr.send(r.ops, false)
		if !testkit.Eventually(60*time.Second, w1.Exited) || !w1.Crashed() {
			t.Fatalf("worker armed with %s did not crash: %s", at, w1.LogTail(3000))
		}
		r.tr.afterKill(r, w1)
	case r.tr.own:
		r.tr.runOwn(r)
	case replay.ScenarioMany:
		r.worker(queueWorkerOptions{})
		r.worker(queueWorkerOptions{})
		r.tr.send(r.newOps(30, func(i int) []string {
			if i%5 == 4 {
				return []string{r.op(i), r.op(i - 2)}
			}
			return []string{r.op(i)}
		}), false)
	}
	r.check(s, start)
}

// check waits until the jobs or messages settled, stops the workers and
// checks the outcome of scenario s, started at start: nothing set aside;
// without the record, some operation had its effect more than once; with
// it, every operation has the effects and the record replay.Expect says,
// a takeover counted where a stale claim was to be taken over, no stale
// claim left, and held operations resolved as a person would.
func (r *queueRun) check(s replay.Scenario, start time.Time) {
	t, e := r.t, r.e
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	want := replay.Expect(s, r.tg.mode, r.tg.policy)
	if s == r.tr.own {
		want = replay.Expect(replay.ScenarioRepeated, r.tg.mode, r.tg.policy)
	}
	done := func() bool {
		if !r.tr.idle() {
			return false
		}
		if r.noRecord {
			return true
		}
		for _, op := range r.ops {
			rec, err := e.store.Get(ctx, r.tg.task, op)
			if err != nil || rec.Status != want.Status {
				return false
			}
		}
		return true
	}
	if !testkit.Eventually(90*time.Second, done) {
		t.Errorf("%s not all settled within 90s (%s idle %v)", r.tr.items, r.tr.idleName, r.tr.idle())
	}
	time.Sleep(500 * time.Millisecond)
	e.stopAll()
	r.tr.setAside(t)
	counts := make([]int, len(r.ops))
	for i, op := range r.ops {
		n, err := r.tg.effects(ctx, e.pool, op)
		if err != nil {
			t.Fatalf("count effects of %s: %v", op, err)
		}
		counts[i] = n
	}
	if r.noRecord {
		dup := 0
		for _, n := range counts {
			if n > 1 {
				dup++
			}
		}
		if dup == 0 {
			t.Errorf("without the record, %s showed no duplicate effect (effects per operation %v)", s, counts)
		} else {
			t.Logf("without the record, as expected: %d of %d operations had their effect more than once (max %d)", dup, len(r.ops), slices.Max(counts))
		}
		return
	}
	for i, op := range r.ops {
		if counts[i] != want.Effects {
			t.Errorf("operation %s: %d effects, want %d (%s, mode %s, policy %s)", op, counts[i], want.Effects, s, r.tg.mode, r.tg.policy)
		}
		rec, err := e.store.Get(ctx, r.tg.task, op)
		if err != nil {
			t.Errorf("operation %s: record: %v", op, err)
		} else if rec.Status != want.Status {
			t.Errorf("operation %s: record %s (%s), want %s", op, rec.Status, rec.Reason, want.Status)
		}
	}
	if want.Takeover {
		var n int64
		stats, err := e.store.Repeats(ctx, start.Add(-time.Minute))
		for _, st := range stats {
			if st.Task == r.tg.task {
				n = st.Takeovers
			}
		}
		if err != nil || n < 1 {
			t.Errorf("takeovers counted: %d (err %v), want at least 1", n, err)
		}
	}
	if n, err := e.store.StaleClaims(ctx); err != nil || n != 0 {
		t.Errorf("stale claims: %d (err %v), want 0", n, err)
	}
	if want.Status == idempotency.StatusHeld && r.tr.resolveHeld != nil && !t.Failed() {
		r.tr.resolveHeld(ctx, r)
	}
}
