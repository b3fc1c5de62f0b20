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

func skScenarios() []replay.Scenario { return queueScenarios(skInWorkingList) }

// TestSidekiqReplay replays demo tasks pushed by Ruby Sidekiq to onceler
// workers (--sidekiq): the same job three times, two workers at once, a
// worker killed (kill -9) after the claim, after the effect and while the
// job sits in its working list (each followed by the producer pushing the
// operation again, and the killed worker's jobs recovered by the next),
// and many distinct operations. With the record every operation has the
// effect count the Celery suite guarantees (replay.Expect) and every job
// leaves Redis; with --no-record each scenario shows a duplicate effect.
func TestSidekiqReplay(t *testing.T) {
	runQueueReplay(t, skTargets(), func(tg skTarget) string { return tg.task }, skScenarios(), skReplay)
}

// skJob is the Sidekiq job of target tg for operation op.
func skJob(tg skTarget, op string) map[string]any {
	return map[string]any{"class": tg.task, "args": tg.args(op)}
}

func skReplay(t *testing.T, tg skTarget, s replay.Scenario, noRecord bool) {
	e := newSkEnv(t)
	r := &queueRun{t: t, e: &e.queueEnv, tg: tg, noRecord: noRecord, prefix: testkit.Name("skr")}
	r.tr = queueTransport{items: "jobs", idleName: "Redis", idle: e.idle, startWorker: e.startWorker,
		send: func(ops []string, same bool) {
			jobs := make([]map[string]any, len(ops))
			for i, op := range ops {
				jobs[i] = skJob(tg, op)
				if same {
					jobs[i]["jid"] = fmt.Sprintf("%024x", slices.Index(r.ops, op)+1)
				}
			}
			e.push(jobs...)
		},
		own: skInWorkingList,
		runOwn: func(r *queueRun) {
			// A worker running one job at a time takes a slow job and,
			// behind it, the operation's job, which waits unstarted in
			// its working list when the worker is killed.
			w1 := r.worker(skWorkerOptions{Concurrency: 1, Prefetch: 2})
			id := w1.identity(t)
			r.ops = []string{r.op(0)}
			e.push(map[string]any{"class": demo.TaskSleep, "args": []any{r.prefix + "-slow", 5}}, skJob(tg, r.op(0)))
			working := "onceler:working:" + id + ":" + e.queue
			testkit.WaitFor(t, "both jobs in the working list", 30*time.Second, func() bool {
				n, err := e.rdb.LLen(context.Background(), working).Result()
				return err == nil && n == 2
			})
			w1.Kill()
			r.tr.afterKill(r, w1)
		},
		afterKill: func(r *queueRun, w *skWorker) { skAfterKill(r, e, w) },
		setAside: func(t *testing.T) {
			var dead []map[string]any
			e.ruby(&dead, "dead", nil)
			if len(dead) != 0 {
				t.Errorf("dead set: %v, want empty", dead)
			}
		},
		resolveHeld: func(ctx context.Context, r *queueRun) { skResolveHeld(ctx, r, e) },
	}
	r.run(s)
}

// skAfterKill waits until the killed worker w counts as dead (its
// heartbeat key expired), then starts another, which recovers its jobs,
// and pushes the operation again (a producer whose call timed out).
func skAfterKill(r *queueRun, e *skEnv, w *skWorker) {
	identity := w.identity(r.t)
	testkit.WaitFor(r.t, "the killed worker's heartbeat to expire", time.Minute, func() bool {
		n, err := e.rdb.Exists(context.Background(), identity).Result()
		return err == nil && n == 0
	})
	r.worker(skWorkerOptions{})
	e.push(skJob(r.tg, r.ops[0]))
}

// skResolveHeld does what a person does with a held operation: --completed
// when its effect happened, else 'onceler resolve --retry --sidekiq',
// which releases the record and pushes the kept job again; a worker runs
// it, and the operation has its effect once.
func skResolveHeld(ctx context.Context, r *queueRun, e *skEnv) {
	t := r.t
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
