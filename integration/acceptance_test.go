package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/internal/testkit"
)

// These tests run onceler worker processes (the onceler binary, worker
// --migrate) on the test's own queue and schema, so they run beside the other
// packages' tests.

// sleepStarted counts the demo.sleep runs a worker's log says began.
func sleepStarted(w *replay.Worker) int {
	return strings.Count(w.Log(), `"sleep started"`)
}

// oneSuccess asserts that every call has exactly one reply, SUCCESS.
func oneSuccess(t *testing.T, e *replay.Env, ms map[string]string) {
	t.Helper()
	for id, op := range ms {
		reps := e.Replies(id)
		if len(reps) != 1 || reps[0].Status != "SUCCESS" {
			t.Errorf("operation %s, caller %s: replies %v, want one SUCCESS", op, id, reps)
		}
	}
}

// sleepEffects asserts that every operation slept (committed its effect)
// exactly once, and returns the total.
func sleepEffects(t *testing.T, e *replay.Env, ms map[string]string) int {
	t.Helper()
	total := 0
	for _, op := range ms {
		n, err := demo.CountSleeps(context.Background(), e.Pool, op)
		if err != nil {
			t.Fatalf("count sleeps of %s: %v", op, err)
		}
		if n != 1 {
			t.Errorf("operation %s: %d effects, want 1", op, n)
		}
		total += n
	}
	return total
}

// queueEmpty asserts that nothing is left in the queue or its quarantine
// and that no claim is stale.
func queueEmpty(t *testing.T, e *replay.Env) {
	t.Helper()
	if n, err := e.QueueDepth(e.Queue); err != nil || n != 0 {
		t.Errorf("queue: %d messages left (err %v), want 0", n, err)
	}
	if q, err := e.TakeQuarantined(); err != nil || len(q) != 0 {
		t.Errorf("quarantine: %v (err %v), want none", q, err)
	}
	if n, err := e.StaleClaims(context.Background()); err != nil || n != 0 {
		t.Errorf("stale claims: %d (err %v), want 0", n, err)
	}
}

// sendSleeps publishes n demo.sleep operations of the given seconds and
// returns task id → operation.
func sendSleeps(e *replay.Env, prefix string, n int, seconds float64) map[string]string {
	ms := make(map[string]string, n)
	for i := range n {
		op := opName(prefix, i)
		ms[e.Send(demo.TaskSleep, []any{op, seconds}, nil)] = op
	}
	return ms
}

func keys(m map[string]string) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

// TestSIGTERMDuringTasks sends SIGTERM to an onceler worker process while
// its tasks run. Within the grace period they finish and are answered by
// that worker, which exits 0; the messages it had not started stay in the
// queue for the next worker. Past the grace period the running tasks are
// cancelled (their transaction rolled back, no effect, no answer) and their
// messages return to the queue; a second worker process completes them.
// Either way: one effect per operation, one answer per caller, queue empty.
func TestSIGTERMDuringTasks(t *testing.T) {
	t.Parallel()
	t.Run("within_grace", func(t *testing.T) {
		e := demoEnv(t)
		a := e.StartWorker(replay.WorkerOptions{Concurrency: 4, Prefetch: 4, Env: []string{"ONCELER_GRACE=30s"}})
		running := sendSleeps(e, "termin"+testkit.NewID()[:4], 4, 3)
		waiting := sendSleeps(e, "termwait"+testkit.NewID()[:4], 4, 0.1)
		if !testkit.Eventually(30*time.Second, func() bool { return sleepStarted(a) >= 4 }) {
			t.Fatalf("%d tasks started, want 4", sleepStarted(a))
		}
		if got := e.ReplyCount(); got != 0 {
			t.Fatalf("%d answered before SIGTERM, want the 4 running", got)
		}
		sent := time.Now()
		if err := a.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		if !a.WaitExit(30 * time.Second) {
			t.Fatal("worker did not exit within its grace period")
		}
		took := time.Since(sent)
		if a.State() != "exit status 0" {
			t.Errorf("worker ended %s, want exit status 0", a.State())
		}
		// The running tasks were answered by the stopping worker, before any
		// other worker existed.
		oneSuccess(t, e, running)
		if n := sleepEffects(t, e, running); n != 4 {
			t.Errorf("%d effects of the running tasks, want 4", n)
		}
		if n, err := e.QueueDepth(e.Queue); err != nil || n != len(waiting) {
			t.Errorf("queue after the stop: %d (err %v), want the %d not started", n, err, len(waiting))
		}
		b := e.StartWorker(replay.WorkerOptions{})
		if !e.WaitReplies(keys(waiting), 1, 60*time.Second) {
			t.Fatal("the waiting tasks were not answered by the next worker")
		}
		b.Stop()
		oneSuccess(t, e, running)
		oneSuccess(t, e, waiting)
		total := sleepEffects(t, e, running) + sleepEffects(t, e, waiting)
		if sleepStarted(b) != len(waiting) {
			t.Errorf("next worker started %d tasks, want %d", sleepStarted(b), len(waiting))
		}
		queueEmpty(t, e)
		t.Logf("SIGTERM with 4 tasks running (3 s each, grace 30 s): exited after %s, 4 answered by it; %d waiting done by the next worker; %d effects for %d operations",
			took.Round(time.Millisecond), len(waiting), total, len(running)+len(waiting))
	})
	t.Run("past_grace", func(t *testing.T) {
		e := demoEnv(t)
		a := e.StartWorker(replay.WorkerOptions{Concurrency: 4, Prefetch: 4, Env: []string{"ONCELER_GRACE=1s"}})
		running := sendSleeps(e, "termpast"+testkit.NewID()[:4], 4, 6)
		if !testkit.Eventually(30*time.Second, func() bool { return sleepStarted(a) >= 4 }) {
			t.Fatalf("%d tasks started, want 4", sleepStarted(a))
		}
		sent := time.Now()
		if err := a.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		if !a.WaitExit(20 * time.Second) {
			t.Fatal("worker did not exit after its grace period")
		}
		took := time.Since(sent)
		if took >= 6*time.Second {
			t.Errorf("worker exited after %s: the tasks were not cut at the 1 s grace", took)
		}
		// Cut: no effect committed, nobody answered, every message back.
		for id, op := range running {
			if n, err := demo.CountSleeps(context.Background(), e.Pool, op); err != nil || n != 0 {
				t.Errorf("operation %s cut by the grace period: %d effects (err %v), want 0", op, n, err)
			}
			if reps := e.Replies(id); len(reps) != 0 {
				t.Errorf("caller %s answered %v by the stopped worker", id, reps)
			}
		}
		if !testkit.Eventually(10*time.Second, func() bool {
			n, err := e.QueueDepth(e.Queue)
			return err == nil && n == len(running)
		}) {
			n, err := e.QueueDepth(e.Queue)
			t.Fatalf("queue after the stop: %d (err %v), want the %d cut tasks back", n, err, len(running))
		}
		b := e.StartWorker(replay.WorkerOptions{Concurrency: 4})
		if !e.WaitReplies(keys(running), 1, 60*time.Second) {
			t.Fatal("the redelivered tasks were not answered by the next worker")
		}
		time.Sleep(time.Second) // a second answer would show here
		b.Stop()
		oneSuccess(t, e, running)
		total := sleepEffects(t, e, running)
		if sleepStarted(b) != len(running) {
			t.Errorf("next worker started %d tasks, want %d", sleepStarted(b), len(running))
		}
		queueEmpty(t, e)
		t.Logf("SIGTERM with 4 tasks running (6 s each, grace 1 s): exited after %s, 0 effects and 0 answers; redelivered and completed by the next worker: %d effects for %d operations",
			took.Round(time.Millisecond), total, len(running))
	})
}

// TestTwoWorkerProcessesDuplicates runs two onceler worker processes on
// one queue with 2,000 messages covering 500 operations of demo.ledger.credit
// (same database), each operation sent 4 times by different callers:
// interleaved for most, back to back (so the two workers take them at the
// same time) for every fifth. Exactly 500 effects, 2,000 results, and the
// repeats report (onceler repeats --json) shows the 1,500 duplicates.
func TestTwoWorkerProcessesDuplicates(t *testing.T) {
	t.Parallel()
	const ops, copies = 500, 4
	e := demoEnv(t)
	since := time.Now()
	e.StartWorker(replay.WorkerOptions{Concurrency: 4, Prefetch: 8})
	e.StartWorker(replay.WorkerOptions{Concurrency: 4, Prefetch: 8})
	wl := newWorkload(e)
	start := time.Now()
	for round := range copies {
		for i := range ops {
			switch {
			case i%5 == 0 && round == 0: // all copies back to back
				for range copies {
					wl.send(demo.TaskCredit, wl.op("twodup", i))
				}
			case i%5 != 0:
				wl.send(demo.TaskCredit, wl.op("twodup", i))
			}
		}
	}
	ids := wl.ids()
	if len(wl.ops) != ops || len(ids) != ops*copies {
		t.Fatalf("sent %d messages for %d operations, want %d for %d", len(ids), len(wl.ops), ops*copies, ops)
	}
	if !e.WaitReplies(ids, 1, 60*time.Second) {
		t.Fatalf("%d of %d calls answered", wl.answered(), len(ids))
	}
	took := time.Since(start)
	time.Sleep(time.Second) // a second answer to a call would show here
	wl.stopWorkers()
	tl := wl.check(t)
	results, effectsTotal := 0, 0
	owners := map[string]int{} // operations completed per worker process
	ctx := context.Background()
	for _, o := range wl.ops {
		n, err := demo.CountLedger(ctx, e.Pool, o.op)
		if err != nil {
			t.Fatal(err)
		}
		effectsTotal += n
		if rec, err := e.Store.Get(ctx, o.task, o.op); err == nil {
			node, _, _ := strings.Cut(rec.Owner, "@") // name@host, as Celery names nodes
			owners[node]++
		}
		var first json.RawMessage
		for _, m := range o.msgs {
			reps := e.Replies(m.ID)
			results += len(reps)
			if len(reps) != 1 || reps[0].Status != "SUCCESS" {
				t.Errorf("operation %s, caller %s: replies %v, want one SUCCESS", o.op, m.ID, reps)
				continue
			}
			if first == nil {
				first = reps[0].Result
			} else if !bytes.Equal(first, reps[0].Result) {
				t.Errorf("operation %s: caller %s got %s, the first got %s", o.op, m.ID, reps[0].Result, first)
			}
		}
	}
	if effectsTotal != ops || results != ops*copies || tl.duplicates != 0 || tl.lost != 0 {
		t.Errorf("effects %d, results %d, %s; want %d effects, %d results", effectsTotal, results, tl, ops, ops*copies)
	}
	for _, w := range e.Workers() {
		if owners[w.Name] == 0 {
			t.Errorf("worker %s completed no operation (owners %v): the two processes did not share the queue", w.Name, owners)
		}
	}
	rep := repeatsReport(t, e, since)
	if rep.Duplicates != ops*(copies-1) || rep.Mismatches != 0 || rep.Failures != 0 || rep.Takeovers != 0 {
		t.Errorf("onceler repeats --json for %s: %+v, want %d duplicates and no takeover, mismatch or failure",
			demo.TaskCredit, rep, ops*(copies-1))
	}
	t.Logf("%d messages, %d operations, 2 workers: answered in %s; %d effects, %d results, repeats report: %d duplicates (takeovers %d); operations completed per worker %v",
		len(ids), len(wl.ops), took.Round(time.Millisecond), effectsTotal, results, rep.Duplicates, rep.Takeovers, owners)
}

// repeatsReport runs the onceler binary's repeats --json on the test's
// schema and returns demo.ledger.credit's line (the only task the report
// may list), read into idempotency.RepeatStats.
func repeatsReport(t *testing.T, e *replay.Env, since time.Time) idempotency.RepeatStats {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	period := (time.Since(since) + time.Minute).Round(time.Minute)
	cmd := exec.CommandContext(ctx, oncelerBin, "repeats", "--json", "--since", fmt.Sprintf("%dm", int(period.Minutes())),
		"--database-url", e.DatabaseURL, "--schema", e.Schema)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("onceler repeats --json: %v\n%s", err, stderr.String())
	}
	var rep struct {
		Since time.Time                 `json:"since"`
		Tasks []idempotency.RepeatStats `json:"tasks"` // keys match its fields' names
	}
	if err := json.Unmarshal(out, &rep); err != nil {
		t.Fatalf("onceler repeats --json: %v\n%s", err, out)
	}
	var credit idempotency.RepeatStats
	for _, r := range rep.Tasks {
		if r.Task != demo.TaskCredit {
			t.Errorf("onceler repeats --json lists %+v, a task the test did not send", r)
			continue
		}
		credit = r
	}
	return credit
}
