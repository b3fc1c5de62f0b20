package integration

import (
	"context"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/internal/testkit"
	"github.com/onceler/onceler/internal/workerhooks"
	"github.com/onceler/onceler/tasks"
)

// These tests only kill, stop and disconnect their own worker processes,
// so they run beside the other packages' tests.

func demoEnv(t *testing.T) *replay.Env {
	e := replay.NewEnv(t, replay.Config{Binary: oncelerBin, Command: []string{"worker", "--migrate"}})
	migrate(t, e)
	return e
}

func ownEnv(t *testing.T, extra ...string) *replay.Env {
	e := replay.NewEnv(t, replay.Config{Binary: ownBin, Env: extra})
	migrate(t, e)
	return e
}

// TestKillMidTaskFullPrefetch kills -9 a worker whose prefetch window is
// full (tasks running, more delivered and waiting), then starts another:
// every message comes back and is done exactly once, every caller answered.
func TestKillMidTaskFullPrefetch(t *testing.T) {
	t.Parallel()
	e := ownEnv(t)
	w1 := e.StartWorker(replay.WorkerOptions{Concurrency: 4, Prefetch: 16})
	wl := newWorkload(e)
	const n = 48
	for i := range n {
		task := []string{demo.TaskSleep, "replay.notify", demo.TaskCharge, demo.TaskSleep}[i%4]
		wl.send(task, wl.op("kill", i))
	}
	if !testkit.Eventually(60*time.Second, func() bool { return wl.answered() >= 4 }) {
		t.Fatalf("only %d answered before the kill", wl.answered())
	}
	before := wl.answered()
	w1.Kill()
	t.Logf("killed %s with %d of %d answered", w1.Name, before, n)
	if before >= n-4 {
		t.Fatalf("the kill came too late to test anything: %d of %d answered", before, n)
	}
	e.StartWorker(replay.WorkerOptions{Concurrency: 4, Prefetch: 16})
	if !wl.wait(2 * time.Minute) {
		t.Errorf("after the kill: %d of %d answered", wl.answered(), n)
	}
	wl.stopWorkers()
	tl := wl.check(t)
	t.Logf("%s", tl)
	if tl.retried > 0 {
		t.Logf("%d replay.notify operations ran twice (policy retry allows it when killed after the effect)", tl.retried)
	}
}

// TestStopPastLeaseSameDB stops (SIGSTOP) a worker in the middle of a
// same-database task for longer than its lease and its broker heartbeat:
// the broker closes its connection and redelivers to a second worker,
// which waits on the open transaction's row lock. After SIGCONT the first
// worker commits; its delivery is gone with its channel; the second answers
// from the record. One effect.
func TestStopPastLeaseSameDB(t *testing.T) {
	e := ownEnv(t, "ONCELER_HEARTBEAT=2s")
	w1 := e.StartWorker(replay.WorkerOptions{Concurrency: 1, Prefetch: 1})
	op := opName(testkit.NewID()[:8], 0)
	m := e.Message(demo.TaskSleep, testkit.NewID(), []any{op, 3}, nil)
	e.Publish(m)
	// Stop it while the task sleeps inside its open transaction (its
	// connection idle in transaction).
	inTx := testkit.Eventually(30*time.Second, func() bool {
		var n int
		err := e.Pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = $1 AND state = 'idle in transaction'`, w1.Name).Scan(&n)
		return err == nil && n > 0
	})
	if !inTx {
		t.Fatal("the task never opened its transaction")
	}
	if err := w1.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	w2 := e.StartWorker(replay.WorkerOptions{Concurrency: 1, Prefetch: 1, NoWait: true})
	time.Sleep(12 * time.Second) // past the lease and two heartbeats
	if err := w1.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	if !e.WaitReplies([]string{m.ID}, 1, time.Minute) {
		t.Fatal("no result")
	}
	time.Sleep(2 * time.Second)
	e.StopAll()
	n, err := demo.CountSleeps(context.Background(), e.Pool, op)
	if err != nil || n != 1 {
		t.Errorf("effects %d (err %v), want 1", n, err)
	}
	for _, r := range e.Replies(m.ID) {
		if r.Status != "SUCCESS" {
			t.Errorf("result %s %s", r.Status, r.Result)
		}
	}
	if d, err := e.QueueDepth(e.Queue); err != nil || d != 0 {
		t.Errorf("queue depth %d (err %v)", d, err)
	}
	// The old owner's delivery died with its channel (the second worker
	// answered the redelivery from the record): it sends nothing when it
	// sees that before answering, and its ack is refused when it answers
	// first (it learns of the closed channel as it resumes, the task's
	// commit racing with it).
	if log := w1.Log(); !strings.Contains(log, "delivery lost while the task ran") && !strings.Contains(log, "ack failed") {
		t.Errorf("the stopped worker's log shows neither its delivery lost nor a refused ack:\n%s", w1.LogTail(3000))
	}
	t.Logf("replies: %d (the redelivery answered by %s; the old owner after SIGCONT only if it answered before it saw its channel closed)", len(e.Replies(m.ID)), w2.Name)
}

// TestStopPastLeaseOutside stops (SIGSTOP) a worker in the middle of an
// outside-system task (policy retry) past its lease; the producer re-sends
// the operation; a second worker takes the stale claim over and completes
// it. After SIGCONT the old owner's late writes are refused: the record
// stays the second worker's completion. At most two effects (policy
// retry). That a completion, renewal or release with a taken-over token is
// refused while the new owner still holds the claim is proven against the
// record itself (idempotency TestStaleTakeOverFencesOldOwner and the model
// test).
func TestStopPastLeaseOutside(t *testing.T) {
	e := ownEnv(t, "ONCELER_HEARTBEAT=2s")
	w1 := e.StartWorker(replay.WorkerOptions{Concurrency: 1, Prefetch: 1})
	op := opName(testkit.NewID()[:8], 0)
	first := e.Message("replay.slow", testkit.NewID(), []any{op, 2}, nil)
	e.Publish(first)
	if !testkit.Eventually(30*time.Second, func() bool {
		rec, err := e.Store.Get(context.Background(), "replay.slow", op)
		return err == nil && rec.Status == idempotency.StatusClaimed
	}) {
		t.Fatal("never claimed")
	}
	// The task starts just after its claim commits, then sleeps 2 s: stop
	// it in its sleep.
	time.Sleep(500 * time.Millisecond)
	if err := w1.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	w2 := e.StartWorker(replay.WorkerOptions{Concurrency: 1, Prefetch: 1, NoWait: true})
	second := e.Message("replay.slow", testkit.NewID(), []any{op, 2}, nil)
	e.Publish(second)
	if !e.WaitReplies([]string{second.ID}, 1, time.Minute) {
		t.Fatal("the re-sent operation got no result while the first owner was stopped")
	}
	rec, err := e.Store.Get(context.Background(), "replay.slow", op)
	if err != nil || rec.Status != idempotency.StatusCompleted || rec.Owner != w2.Name {
		t.Fatalf("record %+v (err %v), want completed by %s", rec.Status, err, w2.Name)
	}
	if time.Since(start) < replay.DefaultLease {
		t.Errorf("taken over after %s, before the lease lapsed", time.Since(start))
	}
	if err := w1.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	if !e.WaitReplies([]string{first.ID}, 1, time.Minute) {
		t.Fatal("the first caller got no result")
	}
	time.Sleep(3 * time.Second)
	e.StopAll()
	rec2, err := e.Store.Get(context.Background(), "replay.slow", op)
	if err != nil || rec2.Owner != w2.Name || rec2.Token != rec.Token || rec2.Status != idempotency.StatusCompleted {
		t.Errorf("after SIGCONT the record is %s owned by %s (err %v): the old owner was not fenced", rec2.Status, rec2.Owner, err)
	}
	log1 := w1.Log()
	n, err := countOwn("replay.slow")(context.Background(), e.Pool, op)
	switch {
	case strings.Contains(log1, "taken over") || strings.Contains(log1, "lease lost"):
		if err != nil || n < 1 || n > 2 {
			t.Errorf("effects %d (err %v), want 1 or 2 (policy retry)", n, err)
		}
	case strings.Contains(log1, "claim lapsed before the task started"):
		// On a machine slow enough that the stop came between the claim
		// and the task's start, the old owner did not start it at all.
		if err != nil || n != 1 {
			t.Errorf("effects %d (err %v), want 1: the old owner stopped before its task started", n, err)
		}
	default:
		t.Errorf("the old owner's log shows no refused completion:\n%s", w1.LogTail(3000))
	}
	for _, id := range []string{first.ID, second.ID} {
		for _, r := range e.Replies(id) {
			if r.Status != "SUCCESS" {
				t.Errorf("caller %s: %s %s", id, r.Status, r.Result)
			}
		}
	}
	if d, err := e.QueueDepth(e.Queue); err != nil || d != 0 {
		t.Errorf("queue depth %d (err %v)", d, err)
	}
	t.Logf("effects %d; takeover after %s", n, time.Since(start).Round(time.Millisecond))
}

// TestPoisonAlwaysFails sends a task that always fails and one that asks
// for a retry every time: each is answered FAILURE after a bounded number of
// attempts (one; max_retries 3 + 1) and acknowledged; nothing loops.
func TestPoisonAlwaysFails(t *testing.T) {
	t.Parallel()
	e := demoEnv(t)
	e.StartWorker(replay.WorkerOptions{})
	fail := e.Send(demo.TaskFail, []any{"always"}, nil)
	op := opName(testkit.NewID()[:8], 0)
	flaky := e.Send(demo.TaskFlaky, []any{op, 100}, nil)
	if !testkit.Eventually(60*time.Second, func() bool {
		return len(e.Replies(fail)) >= 1 && hasStatus(e.Replies(flaky), "FAILURE")
	}) {
		t.Fatalf("fail: %v; flaky: %v", e.Replies(fail), e.Replies(flaky))
	}
	time.Sleep(3 * time.Second) // room for a loop to show
	e.StopAll()
	if r := e.Replies(fail); len(r) != 1 || r[0].Status != "FAILURE" || r[0].ExcType != "ValueError" {
		t.Errorf("demo.fail results %v, want one FAILURE ValueError", r)
	}
	var retries, failures int
	for _, r := range e.Replies(flaky) {
		switch r.Status {
		case "RETRY":
			retries++
		case "FAILURE":
			failures++
		}
	}
	if retries != 3 || failures != 1 {
		t.Errorf("demo.flaky: %d RETRY and %d FAILURE results, want 3 and 1 (max_retries 3)", retries, failures)
	}
	if d, err := e.QueueDepth(e.Queue); err != nil || d != 0 {
		t.Errorf("queue depth %d (err %v)", d, err)
	}
	rec, err := e.Store.Get(context.Background(), demo.TaskFlaky, op)
	if err != nil || rec.Status != idempotency.StatusFailed {
		t.Errorf("demo.flaky record %s (err %v), want failed", rec.Status, err)
	}
}

func hasStatus(rs []replay.Reply, s string) bool {
	for _, r := range rs {
		if r.Status == s {
			return true
		}
	}
	return false
}

// TestPoisonCrashLoop sends a task that kills its worker every time (crash
// injection after the claim, a new worker started after each death): after
// a bounded number of attempts the message is quarantined as poison; no
// endless redelivery loop, no effect. An outside task is counted by its
// record's claims; a same-database task's claim dies with its transaction,
// so on a quorum queue the delivery count bounds it, and on a classic queue
// the worker must count its attempts some other way (outside the rolled
// back transaction): the samedb_classic case asserts that it does.
func TestPoisonCrashLoop(t *testing.T) {
	t.Parallel()
	// The bound is the worker's default MaxAttempts (5): an outside
	// operation is quarantined at its 6th claim, so after 5 crashes; a
	// same-database message when delivered (quorum) or redelivered
	// (classic) more than 5 times, so after 6.
	const limit = 5
	cases := []struct {
		name, task string
		quorum     bool
		effects    func(context.Context, demo.Querier, string) (int, error)
		crashes    int
	}{
		{"outside_classic", demo.TaskCharge, false, demo.CountGatewayCalls, limit},
		{"samedb_quorum", demo.TaskCredit, true, demo.CountLedger, limit + 1},
		{"samedb_classic", demo.TaskCredit, false, demo.CountLedger, limit + 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			e := replay.NewEnv(t, replay.Config{Binary: ownBin, Quorum: c.quorum})
			migrate(t, e)
			op := opName(testkit.NewID()[:8], 0)
			m := e.Message(c.task, testkit.NewID(), args(c.task, op), nil)
			e.Publish(m)
			crashes := 0
			for {
				w := e.StartWorker(replay.WorkerOptions{CrashAt: workerhooks.AfterClaim, CrashTask: c.task, Concurrency: 1, Prefetch: 1, NoWait: true})
				quarantined := func() bool { n, err := e.QueueDepth(e.Quarantine); return err == nil && n > 0 }
				if !testkit.Eventually(30*time.Second, func() bool { return w.Exited() || quarantined() }) {
					t.Fatalf("worker %s neither crashed nor quarantined the message", w.Name)
				}
				if !w.Exited() {
					break
				}
				crashes++
				if crashes > 10 {
					t.Fatalf("%d crashes: the poison message loops", crashes)
				}
			}
			time.Sleep(time.Second)
			e.StopAll()
			q, err := e.TakeQuarantined()
			if err != nil || len(q) != 1 || q[0].Reason != tasks.ReasonPoison || q[0].TaskID != m.ID {
				t.Errorf("quarantine %v (err %v), want the message as poison", q, err)
			}
			if n, err := c.effects(context.Background(), e.Pool, op); err != nil || n != 0 {
				t.Errorf("%d effects (err %v), want 0", n, err)
			}
			if d, err := e.QueueDepth(e.Queue); err != nil || d != 0 {
				t.Errorf("queue depth %d (err %v)", d, err)
			}
			if n, err := e.StaleClaims(context.Background()); err != nil || n != 0 {
				t.Errorf("stale claims %d (err %v)", n, err)
			}
			if crashes != c.crashes {
				t.Errorf("quarantined after %d crashes, want %d (MaxAttempts %d)", crashes, c.crashes, limit)
			}
			t.Logf("quarantined after %d crashes", crashes)
		})
	}
}

// TestDuplicateIDDifferentArguments sends two messages with the same task
// id and operation key but different arguments, at once, to two workers:
// one runs; the other is reported as a fingerprint mismatch (FAILURE to its
// caller, quarantined) and has no effect.
func TestDuplicateIDDifferentArguments(t *testing.T) {
	t.Parallel()
	e := demoEnv(t)
	e.StartWorker(replay.WorkerOptions{})
	e.StartWorker(replay.WorkerOptions{})
	id := testkit.NewID()
	op := opName(id[:8], 0)
	e.Publish(e.Message(demo.TaskCredit, id, []any{"acct-" + op, op, 100}, nil))
	e.Publish(e.Message(demo.TaskCredit, id, []any{"acct-" + op, op, 9900}, nil))
	if !e.WaitReplies([]string{id}, 2, time.Minute) {
		t.Fatalf("results %v, want 2", e.Replies(id))
	}
	e.StopAll()
	var ok, mismatch int
	for _, r := range e.Replies(id) {
		switch {
		case r.Status == "SUCCESS":
			ok++
		case r.Status == "FAILURE" && strings.Contains(string(r.Result), "different arguments"):
			mismatch++
		default:
			t.Errorf("result %s %s", r.Status, r.Result)
		}
	}
	if ok != 1 || mismatch != 1 {
		t.Errorf("%d SUCCESS and %d mismatch FAILURE, want 1 and 1", ok, mismatch)
	}
	q, err := e.TakeQuarantined()
	if err != nil || len(q) != 1 || q[0].Reason != tasks.ReasonMismatch {
		t.Errorf("quarantine %v (err %v), want one fingerprint_mismatch", q, err)
	}
	if n, err := demo.CountLedger(context.Background(), e.Pool, op); err != nil || n != 1 {
		t.Errorf("ledger rows %d (err %v), want 1", n, err)
	}
	if d, err := e.QueueDepth(e.Queue); err != nil || d != 0 {
		t.Errorf("queue depth %d (err %v)", d, err)
	}
}

// TestTerminateWorkerBackends terminates, twice, every PostgreSQL
// connection of the workers (found by their application_name) in the
// middle of a stream of same-database tasks: nothing is lost, nothing done
// twice. (The demo's simulated outside systems share the workers' pool, so
// outside tasks would fail for their own reasons here.)
func TestTerminateWorkerBackends(t *testing.T) {
	e := ownEnv(t)
	w1 := e.StartWorker(replay.WorkerOptions{})
	w2 := e.StartWorker(replay.WorkerOptions{})
	wl := newWorkload(e)
	const n = 200
	for i := range n {
		task := demo.TaskCredit
		if i%10 == 0 {
			task = demo.TaskSleep
		}
		wl.send(task, wl.op("term", i))
	}
	terminate := func() int {
		var k int
		err := e.Pool.QueryRow(context.Background(),
			`SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name IN ($1, $2)`,
			w1.Name, w2.Name).Scan(&k)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	// A worker whose connections were just terminated may hold none for a
	// moment (its deliveries wait to be retried): try again until one has
	// some, while the workload still runs.
	terminateSome := func() int {
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			if k := terminate(); k > 0 || wl.answered() >= n || time.Now().After(deadline) {
				return k
			}
		}
	}
	testkit.Eventually(time.Minute, func() bool { return wl.answered() >= n/5 })
	k1 := terminateSome()
	testkit.Eventually(time.Minute, func() bool { return wl.answered() >= n/2 })
	k2 := terminateSome()
	if !wl.wait(2 * time.Minute) {
		t.Errorf("%d of %d answered", wl.answered(), n)
	}
	wl.stopWorkers()
	tl := wl.check(t)
	t.Logf("terminated %d and %d backends; %s", k1, k2, tl)
	if k1 == 0 || k2 == 0 {
		t.Errorf("terminated %d and %d backends: the fault did not happen", k1, k2)
	}
	if tl.held > 0 {
		t.Errorf("%d operations held: no worker died, nothing should go stale", tl.held)
	}
}
