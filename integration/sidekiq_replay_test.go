package integration

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/internal/testkit"
	"github.com/onceler/onceler/internal/workerhooks"
	"github.com/onceler/onceler/tasks"
)

// skTarget is a demo task replayed through Sidekiq: its positional
// arguments for operation op and the count of op's effects.
type skTarget struct {
	task    string
	mode    tasks.Mode
	policy  tasks.Policy
	args    func(op string) []any
	effects func(ctx context.Context, pool *pgxpool.Pool, op string) (int, error)
}

func skTargets() []skTarget {
	return []skTarget{
		{task: demo.TaskCredit, mode: tasks.ModeSameDB,
			args: func(op string) []any { return []any{"acct-" + op, op, 125} },
			effects: func(ctx context.Context, pool *pgxpool.Pool, op string) (int, error) {
				return demo.CountLedger(ctx, pool, op)
			}},
		{task: demo.TaskCharge, mode: tasks.ModeOutside, policy: tasks.PolicyLookup,
			args: func(op string) []any { return []any{op, 990} },
			effects: func(ctx context.Context, pool *pgxpool.Pool, op string) (int, error) {
				return demo.CountGatewayCalls(ctx, pool, op)
			}},
		{task: demo.TaskEmail, mode: tasks.ModeOutside, policy: tasks.PolicyHold,
			args: func(op string) []any { return []any{op, "someone@example.com", "hello"} },
			effects: func(ctx context.Context, pool *pgxpool.Pool, op string) (int, error) {
				return demo.CountEmailSends(ctx, pool, op)
			}},
	}
}

// The Sidekiq replay scenarios: the Celery suite's (replay.Scenario), and
// a worker killed while the job sits unstarted in its working list.
const skInWorkingList replay.Scenario = "killed_in_working_list"

func skScenarios() []replay.Scenario {
	return []replay.Scenario{replay.ScenarioRepeated, replay.ScenarioConcurrent, replay.ScenarioCrashAfterClaim,
		replay.ScenarioCrashAfterEffect, skInWorkingList, replay.ScenarioMany}
}

// TestSidekiqReplay replays demo tasks pushed by Ruby Sidekiq to onceler
// workers (--sidekiq): the same job three times, two workers at once, a
// worker killed (kill -9) after the claim, after the effect and while the
// job sits in its working list (each followed by the producer pushing the
// operation again, and the killed worker's jobs recovered by the next),
// and many distinct operations. With the record every operation has the
// effect count the Celery suite guarantees (replay.Expect) and every job
// leaves Redis; with --no-record each scenario shows a duplicate effect.
func TestSidekiqReplay(t *testing.T) {
	t.Parallel()
	for _, tg := range skTargets() {
		t.Run(tg.task, func(t *testing.T) {
			t.Parallel()
			for _, s := range skScenarios() {
				t.Run(string(s), func(t *testing.T) {
					t.Run("record", func(t *testing.T) { skReplay(t, tg, s, false) })
					t.Run("no_record", func(t *testing.T) { skReplay(t, tg, s, true) })
				})
			}
		})
	}
}

type skRun struct {
	t        *testing.T
	e        *skEnv
	tg       skTarget
	noRecord bool
	prefix   string
	ops      []string
}

func (r *skRun) job(op string) map[string]any {
	return map[string]any{"class": r.tg.task, "args": r.tg.args(op)}
}

func (r *skRun) worker(o skWorkerOptions) *skWorker {
	o.NoRecord = r.noRecord
	return r.e.startWorker(o)
}

func skReplay(t *testing.T, tg skTarget, s replay.Scenario, noRecord bool) {
	r := &skRun{t: t, e: newSkEnv(t), tg: tg, noRecord: noRecord, prefix: testkit.Name("skr")}
	op := func(i int) string { return fmt.Sprintf("%s-%d", r.prefix, i) }
	start := time.Now()
	switch s {
	case replay.ScenarioRepeated:
		// The same job (same jid) pushed three times in a row.
		r.worker(skWorkerOptions{})
		var jobs []map[string]any
		for i := range 3 {
			r.ops = append(r.ops, op(i))
			for range 3 {
				j := r.job(op(i))
				j["jid"] = fmt.Sprintf("%024x", i+1)
				jobs = append(jobs, j)
			}
		}
		r.e.push(jobs...)
	case replay.ScenarioConcurrent:
		r.worker(skWorkerOptions{})
		r.worker(skWorkerOptions{})
		var jobs []map[string]any
		for i := range 5 {
			r.ops = append(r.ops, op(i))
			jobs = append(jobs, r.job(op(i)), r.job(op(i)))
		}
		r.e.push(jobs...)
	case replay.ScenarioCrashAfterClaim, replay.ScenarioCrashAfterEffect:
		at := workerhooks.AfterClaim
		if s == replay.ScenarioCrashAfterEffect {
			at = workerhooks.AfterEffect
		}
		w1 := r.worker(skWorkerOptions{CrashAt: at, CrashTask: tg.task, Concurrency: 1, Prefetch: 1})
		id := w1.identity(t)
		r.ops = []string{op(0)}
		r.e.push(r.job(op(0)))
		if !testkit.Eventually(60*time.Second, w1.Exited) || !w1.Crashed() {
			t.Fatalf("worker armed with %s did not crash: %s", at, w1.LogTail(3000))
		}
		r.afterKill(id)
	case skInWorkingList:
		// A worker running one job at a time takes a slow job and, behind
		// it, the operation's job, which waits unstarted in its working
		// list when the worker is killed.
		w1 := r.worker(skWorkerOptions{Concurrency: 1, Prefetch: 2})
		id := w1.identity(t)
		r.ops = []string{op(0)}
		r.e.push(map[string]any{"class": demo.TaskSleep, "args": []any{r.prefix + "-slow", 5}}, r.job(op(0)))
		working := "onceler:working:" + id + ":" + r.e.queue
		testkit.WaitFor(t, "both jobs in the working list", 30*time.Second, func() bool {
			n, err := r.e.rdb.LLen(context.Background(), working).Result()
			return err == nil && n == 2
		})
		w1.Kill()
		r.afterKill(id)
	case replay.ScenarioMany:
		r.worker(skWorkerOptions{})
		r.worker(skWorkerOptions{})
		var jobs []map[string]any
		for i := range 30 {
			r.ops = append(r.ops, op(i))
			jobs = append(jobs, r.job(op(i)))
			if i%5 == 4 {
				jobs = append(jobs, r.job(op(i-2)))
			}
		}
		r.e.push(jobs...)
	}
	r.check(s, start)
}

// afterKill waits until the killed worker counts as dead (its heartbeat
// key expired), then starts another, which recovers its jobs, and pushes
// the operation again (a producer whose call timed out).
func (r *skRun) afterKill(identity string) {
	testkit.WaitFor(r.t, "the killed worker's heartbeat to expire", time.Minute, func() bool {
		n, err := r.e.rdb.Exists(context.Background(), identity).Result()
		return err == nil && n == 0
	})
	r.worker(skWorkerOptions{})
	r.e.push(r.job(r.ops[0]))
}

func (r *skRun) check(s replay.Scenario, start time.Time) {
	t, e := r.t, r.e
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	want := replay.Expect(s, r.tg.mode, r.tg.policy)
	if s == skInWorkingList {
		want = replay.Expect(replay.ScenarioRepeated, r.tg.mode, r.tg.policy)
	}
	done := func() bool {
		if !e.idle() {
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
		t.Errorf("jobs not all settled within 90s (Redis idle %v)", e.idle())
	}
	time.Sleep(500 * time.Millisecond)
	e.stopAll()
	var dead []map[string]any
	e.ruby(&dead, "dead", nil)
	if len(dead) != 0 {
		t.Errorf("dead set: %v, want empty", dead)
	}
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
	if want.Status == idempotency.StatusHeld && !t.Failed() {
		r.resolveHeld(ctx)
	}
}

// resolveHeld does what a person does with a held operation: --completed
// when its effect happened, else 'onceler resolve --retry --sidekiq',
// which releases the record and pushes the kept job again; a worker runs
// it, and the operation has its effect once.
func (r *skRun) resolveHeld(ctx context.Context) {
	t, e := r.t, r.e
	for _, op := range r.ops {
		n, err := r.tg.effects(ctx, e.pool, op)
		if err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			if err := e.store.ResolveCompleted(ctx, r.tg.task, op, nil); err != nil {
				t.Fatalf("resolve completed: %v", err)
			}
			continue
		}
		cmd := exec.Command(oncelerBin, "resolve", "--retry", "--sidekiq", e.redisURL, r.tg.task, op)
		cmd.Env = append(os.Environ(), "ONCELER_DATABASE_URL="+e.dbURL, "ONCELER_SCHEMA="+e.schema)
		out, err := cmd.CombinedOutput()
		if err != nil || !strings.Contains(string(out), "pushed again to Sidekiq queue "+e.queue) {
			t.Fatalf("onceler resolve --retry: %v: %s", err, out)
		}
		r.worker(skWorkerOptions{})
		testkit.WaitFor(t, "the pushed job run", time.Minute, func() bool {
			rec, err := e.store.Get(ctx, r.tg.task, op)
			return err == nil && rec.Status == idempotency.StatusCompleted && e.idle()
		})
		e.stopAll()
		t.Logf("operation %s held before its effect: resolve --retry pushed its job again, run once", op)
	}
	for _, op := range r.ops {
		if n, err := r.tg.effects(ctx, e.pool, op); err != nil || n != 1 {
			t.Errorf("operation %s after resolving: %d effects (err %v), want 1", op, n, err)
		}
	}
}
