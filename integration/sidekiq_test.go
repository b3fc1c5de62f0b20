package integration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testkit"
)

// creditJob is a Sidekiq job of demo.ledger.credit for entry op.
func creditJob(op string) map[string]any {
	return map[string]any{"class": demo.TaskCredit, "args": []any{"acct-" + op, op, 125}}
}

// ledgerOrder returns the entries of the ledger whose entry ids start with
// prefix, in the order they were written.
func ledgerOrder(t *testing.T, e *skEnv, prefix string) []string {
	t.Helper()
	rows, err := e.pool.Query(context.Background(),
		`SELECT entry_id FROM onceler_demo.ledger WHERE entry_id LIKE $1 || '%' ORDER BY created_at`, prefix)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		out = append(out, id)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestSidekiqQueues: --queues without weights takes Sidekiq's queues in
// strict order (every job of the first before any of the second), with
// weights (critical,1,low,1) in a random order that mixes them.
func TestSidekiqQueues(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, queues string
		strict       bool
	}{{"strict", "critical,low", true}, {"weighted", "critical,1,low,1", false}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newSkEnv(t)
			prefix := testkit.Name("skq")
			var jobs []map[string]any
			for i := range 20 {
				for _, q := range []string{"low", "critical"} {
					j := creditJob(fmt.Sprintf("%s-%s-%02d", prefix, q, i))
					j["queue"] = q
					jobs = append(jobs, j)
				}
			}
			e.push(jobs...)
			e.startWorker(skWorkerOptions{Queues: tc.queues, Concurrency: 1, Prefetch: 1})
			testkit.WaitFor(t, "every job run", time.Minute, func() bool { return len(ledgerOrder(t, e, prefix)) == 40 && e.idle() })
			order := ledgerOrder(t, e, prefix)
			firstLow := -1
			lowInFirst20 := 0
			for i, id := range order {
				if strings.Contains(id, "-low-") {
					if firstLow < 0 {
						firstLow = i
					}
					if i < 20 {
						lowInFirst20++
					}
				}
			}
			if tc.strict && firstLow != 20 {
				t.Errorf("strict order: the first low job ran %dth, want 21st (after the 20 critical ones): %v", firstLow+1, order)
			}
			if !tc.strict && (lowInFirst20 == 0 || lowInFirst20 == 20) {
				t.Errorf("weighted 1:1: %d low jobs among the first 20 run, want both queues mixed: %v", lowInFirst20, order)
			}
			t.Logf("%s: %d of the first 20 jobs from low", tc.name, lowInFirst20)
		})
	}
}

// TestSidekiqScheduled: a job pushed with "at" (perform_in) waits in the
// schedule set and runs once it is due, moved by the worker's scheduler.
func TestSidekiqScheduled(t *testing.T) {
	t.Parallel()
	e := newSkEnv(t)
	e.startWorker(skWorkerOptions{})
	op := testkit.Name("skat")
	j := creditJob(op)
	due := time.Now().Add(3 * time.Second)
	j["at"] = float64(due.UnixMilli()) / 1000
	e.push(j)
	var scheduled []map[string]any
	e.ruby(&scheduled, "scheduled", nil)
	if len(scheduled) != 1 {
		t.Fatalf("scheduled set %v, want the job", scheduled)
	}
	testkit.WaitFor(t, "the scheduled job run", time.Minute, func() bool { return len(ledgerOrder(t, e, op)) == 1 })
	var at time.Time
	if err := e.pool.QueryRow(context.Background(), `SELECT created_at FROM onceler_demo.ledger WHERE entry_id = $1`, op).Scan(&at); err != nil {
		t.Fatal(err)
	}
	if at.Before(due.Add(-time.Second)) {
		t.Errorf("the job ran at %s, before it was due at %s", at, due)
	}
	testkit.WaitFor(t, "Redis idle", 30*time.Second, e.idle)
}

type skEntry struct {
	JID   string         `json:"jid"`
	Item  map[string]any `json:"item"`
	Value string         `json:"value"`
}

// TestSidekiqRetryAndDead: a failing job goes to Sidekiq's retry set with
// Sidekiq's fields (retry_count 0, error_class, error_message, failed_at,
// due 15 s or more later); with retry 0 straight to the dead set; with
// retry false nowhere. Sidekiq::Stats counts the failures. An outside task
// that asks for a retry releases its claim, and its retried run (the retry
// made due now) claims again and completes.
func TestSidekiqRetryAndDead(t *testing.T) {
	t.Parallel()
	e := newSkEnv(t)
	w := e.startWorker(skWorkerOptions{})
	flakyOp := testkit.Name("skflaky")
	jids := e.push(
		map[string]any{"class": demo.TaskFail, "args": []any{"boom"}, "retry": 3},
		map[string]any{"class": demo.TaskFail, "args": []any{"dead at once"}, "retry": 0},
		map[string]any{"class": demo.TaskFail, "args": []any{"dropped"}, "retry": false},
		map[string]any{"class": demo.TaskFlaky, "args": []any{flakyOp, 1}},
	)
	var retries, dead []skEntry
	testkit.WaitFor(t, "two retries and one dead job", 30*time.Second, func() bool {
		e.ruby(&retries, "retries", nil)
		e.ruby(&dead, "dead", nil)
		return len(retries) == 2 && len(dead) == 1
	})
	byJID := map[string]map[string]any{}
	for _, r := range retries {
		byJID[r.JID] = r.Item
	}
	r := byJID[jids[0]]
	if r == nil || r["retry_count"] != 0.0 || r["error_class"] != "ValueError" || r["error_message"] != "boom" ||
		r["failed_at"] == nil || r["queue"] != e.queue || r["retry"] != 3.0 {
		t.Errorf("retry set entry of the failed job: %v; want retry_count 0, error_class ValueError, error_message boom, failed_at, queue %s", r, e.queue)
	}
	if f := byJID[jids[3]]; f == nil || f["retry_count"] != 0.0 || !strings.Contains(fmt.Sprint(f["error_message"]), "flaky failure") {
		t.Errorf("retry set entry of the flaky job: %v; want retry_count 0 and its retry's cause", f)
	}
	if d := dead[0]; d.JID != jids[1] || d.Item["error_class"] != "ValueError" || d.Item["error_message"] != "dead at once" {
		t.Errorf("dead set: %+v, want the retry 0 job with its error", d)
	}
	rec, err := e.store.Get(context.Background(), demo.TaskFlaky, flakyOp)
	if err != nil || rec.Status != idempotency.StatusFailed {
		t.Errorf("flaky operation's record after its retry: %+v, %v; want failed (claimable again)", rec, err)
	}
	var stats struct {
		Failed    int `json:"failed"`
		Processed int `json:"processed"`
	}
	testkit.WaitFor(t, "stats written at a heartbeat", 10*time.Second, func() bool {
		e.ruby(&stats, "stats", nil)
		return stats.Failed >= 4
	})

	// The flaky job's retry, made due now: the scheduler moves it to its
	// queue and its run (retry_count 0: the task's second try) succeeds.
	ctx := context.Background()
	members, err := e.rdb.ZRange(ctx, "retry", 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range members {
		if strings.Contains(m, jids[3]) {
			if err := e.rdb.ZAdd(ctx, "retry", redis.Z{Score: 0, Member: m}).Err(); err != nil {
				t.Fatal(err)
			}
		}
	}
	testkit.WaitFor(t, "the flaky operation completed", time.Minute, func() bool {
		rec, err := e.store.Get(ctx, demo.TaskFlaky, flakyOp)
		return err == nil && rec.Status == idempotency.StatusCompleted
	})
	rec, _ = e.store.Get(ctx, demo.TaskFlaky, flakyOp)
	var res demo.FlakyResult
	if err := json.Unmarshal(rec.Result, &res); err != nil || res.Attempts != 2 {
		t.Errorf("flaky result %s, want its second attempt", rec.Result)
	}
	_ = w
}

// TestSidekiqActiveJob: a job wrapped by ActiveJob's Sidekiq adapter runs
// the task its "wrapped" class names with its "arguments".
func TestSidekiqActiveJob(t *testing.T) {
	t.Parallel()
	e := newSkEnv(t)
	e.startWorker(skWorkerOptions{})
	op := testkit.Name("skaj")
	e.push(map[string]any{
		"class":   "ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper",
		"wrapped": demo.TaskCredit,
		"args": []any{map[string]any{
			"job_class": demo.TaskCredit, "job_id": "5b2d7c3e-aj", "provider_job_id": nil, "queue_name": e.queue,
			"priority": nil, "arguments": []any{"acct-" + op, op, 125}, "executions": 0, "exception_executions": map[string]any{},
			"locale": "en", "timezone": "UTC", "enqueued_at": time.Now().UTC().Format(time.RFC3339Nano),
		}},
	})
	testkit.WaitFor(t, "the wrapped job run", time.Minute, func() bool { return len(ledgerOrder(t, e, op)) == 1 })
	rec, err := e.store.Get(context.Background(), demo.TaskCredit, op)
	if err != nil || rec.Status != idempotency.StatusCompleted {
		t.Errorf("record %+v, %v; want completed", rec, err)
	}
	testkit.WaitFor(t, "Redis idle", 30*time.Second, e.idle)
}

// TestSidekiqProcessVisible: the worker is in Sidekiq::ProcessSet with
// busy 1 and in Sidekiq::Workers while a job runs, busy 0 after;
// Sidekiq::Stats counts the job processed.
func TestSidekiqProcessVisible(t *testing.T) {
	t.Parallel()
	e := newSkEnv(t)
	w := e.startWorker(skWorkerOptions{})
	id := w.identity(t)
	op := testkit.Name("skbusy")
	e.push(map[string]any{"class": demo.TaskSleep, "args": []any{op, 4}})
	type proc struct {
		Identity string `json:"identity"`
		Busy     int    `json:"busy"`
		Quiet    string `json:"quiet"`
	}
	busy := func() int {
		var ps []proc
		e.ruby(&ps, "processes", nil)
		for _, p := range ps {
			if p.Identity == id {
				return p.Busy
			}
		}
		return -1
	}
	testkit.WaitFor(t, "busy 1 in Sidekiq::ProcessSet", 15*time.Second, func() bool { return busy() == 1 })
	var workers []struct {
		Process string         `json:"process"`
		Work    map[string]any `json:"work"`
	}
	e.ruby(&workers, "workers", nil)
	if len(workers) != 1 || workers[0].Process != id || !strings.Contains(fmt.Sprint(workers[0].Work["payload"]), op) {
		t.Errorf("Sidekiq::Workers %+v, want the running job of %s", workers, id)
	}
	testkit.WaitFor(t, "busy 0 after the job", 20*time.Second, func() bool { return busy() == 0 })
	var stats struct {
		Processed int `json:"processed"`
	}
	e.ruby(&stats, "stats", nil)
	if stats.Processed < 1 {
		t.Errorf("Sidekiq::Stats processed %d, want 1", stats.Processed)
	}
}

// TestSidekiqSignals: TSTP through Sidekiq's API makes the worker quiet
// (it fetches no more jobs, shown quiet in the process set); TERM stops it
// gracefully: it exits 0, leaves the process set, and the job it did not
// take is still in its queue.
func TestSidekiqSignals(t *testing.T) {
	t.Parallel()
	e := newSkEnv(t)
	w := e.startWorker(skWorkerOptions{})
	id := w.identity(t)
	e.ruby(nil, "signal", map[string]any{"identity": id, "signal": "TSTP"})
	testkit.WaitFor(t, "the worker quiet", 15*time.Second, func() bool { return strings.Contains(w.Log(), "sidekiq TSTP") })
	op := testkit.Name("skquiet")
	e.push(creditJob(op))
	time.Sleep(3 * time.Second)
	if n := len(ledgerOrder(t, e, op)); n != 0 {
		t.Fatalf("a quiet worker ran a job pushed after TSTP")
	}
	var ps []struct {
		Identity string `json:"identity"`
		Quiet    string `json:"quiet"`
	}
	e.ruby(&ps, "processes", nil)
	if len(ps) != 1 || ps[0].Quiet != "true" {
		t.Errorf("process set %+v, want the worker quiet", ps)
	}
	e.ruby(nil, "signal", map[string]any{"identity": id, "signal": "TERM"})
	if !w.WaitExit(30 * time.Second) {
		t.Fatal("the worker did not stop after TERM")
	}
	if !w.Succeeded() {
		t.Errorf("the worker ended %s after TERM, want exit 0", w.State())
	}
	e.ruby(&ps, "processes", nil)
	if len(ps) != 0 {
		t.Errorf("process set after TERM: %+v, want empty", ps)
	}
	if n, err := e.rdb.LLen(context.Background(), "queue:"+e.queue).Result(); err != nil || n != 1 {
		t.Errorf("queue holds %d jobs (err %v), want the one not taken", n, err)
	}
}

// TestSidekiqShutdown: SIGTERM lets a running job finish within --grace
// (its effect once, the job gone) and hands the jobs not started back to
// the head of their queue.
func TestSidekiqShutdown(t *testing.T) {
	t.Parallel()
	e := newSkEnv(t)
	w := e.startWorker(skWorkerOptions{Concurrency: 1, Prefetch: 3})
	id := w.identity(t)
	op := testkit.Name("skstop")
	e.push(map[string]any{"class": demo.TaskSleep, "args": []any{op + "-run", 2}}, creditJob(op+"-a"), creditJob(op+"-b"))
	working := "onceler:working:" + id + ":" + e.queue
	testkit.WaitFor(t, "three jobs in the working list", 15*time.Second, func() bool {
		n, err := e.rdb.LLen(context.Background(), working).Result()
		return err == nil && n == 3
	})
	if err := w.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if !w.WaitExit(30 * time.Second) {
		t.Fatal("the worker did not stop after SIGTERM")
	}
	n, err := demo.CountSleeps(context.Background(), e.pool, op+"-run")
	if err != nil || n != 1 {
		t.Errorf("the running job's effect: %d (err %v), want 1 (finished within the grace period)", n, err)
	}
	if got := ledgerOrder(t, e, op); len(got) != 0 {
		t.Errorf("jobs not started ran: %v", got)
	}
	queued, err := e.rdb.LRange(context.Background(), "queue:"+e.queue, 0, -1).Result()
	if err != nil || len(queued) != 2 {
		t.Fatalf("queue after the stop: %v (err %v), want the two jobs not started", queued, err)
	}
	if l, _ := e.rdb.LLen(context.Background(), working).Result(); l != 0 {
		t.Errorf("working list after the stop: %d jobs, want 0", l)
	}
	// A new worker runs them.
	e.startWorker(skWorkerOptions{})
	testkit.WaitFor(t, "the requeued jobs run", time.Minute, func() bool { return len(ledgerOrder(t, e, op)) == 2 })
}

// TestSidekiqBadInput: a job of an unknown class, one whose arguments do
// not bind and one that is JSON but not a job hash go to the dead set at
// once, each with an error class and message that say why; one that is not
// JSON at all goes there as it came; none is retried.
func TestSidekiqBadInput(t *testing.T) {
	t.Parallel()
	e := newSkEnv(t)
	e.startWorker(skWorkerOptions{})
	jids := e.push(
		map[string]any{"class": "Billing::NoSuchJob", "args": []any{1}},
		map[string]any{"class": demo.TaskCredit, "args": []any{"only-one"}},
	)
	ctx := context.Background()
	if err := e.rdb.LPush(ctx, "queue:"+e.queue, "[1, 2]", "{not json").Err(); err != nil {
		t.Fatal(err)
	}
	var dead []skEntry
	testkit.WaitFor(t, "four dead jobs", 30*time.Second, func() bool {
		e.ruby(&dead, "dead", nil)
		return len(dead) == 4
	})
	classes := map[string]string{}
	for _, d := range dead {
		key := d.JID
		switch {
		case len(d.Item) == 0 || d.Item["class"] == nil:
			key = "not JSON"
			classes[key] = d.Value
			continue
		case d.JID != jids[0] && d.JID != jids[1]:
			key = "not a hash"
		}
		classes[key] = fmt.Sprint(d.Item["error_class"]) + ": " + fmt.Sprint(d.Item["error_message"])
	}
	for key, want := range map[string]string{
		jids[0]:      "Onceler::UnknownTask: task \"Billing::NoSuchJob\" is not registered",
		jids[1]:      "Onceler::BadArguments: bad arguments for demo.ledger.credit",
		"not a hash": "Onceler::UndecodableJob: ",
		// Not JSON: kept in the dead set as it came, where Sidekiq's API
		// can read and delete it.
		"not JSON": "{not json",
	} {
		if !strings.HasPrefix(classes[key], want) {
			t.Errorf("dead job %s: %q, want %q...", key, classes[key], want)
		}
	}
	b, _ := json.Marshal(classes)
	t.Logf("dead set: %s", b)
	var retries []skEntry
	e.ruby(&retries, "retries", nil)
	if len(retries) != 0 {
		t.Errorf("retry set %v, want empty", retries)
	}
	testkit.WaitFor(t, "Redis idle", 10*time.Second, e.idle)
}

// TestSidekiqPoison: a job that kills every worker that runs it (kill -9
// after the claim) is recovered from each dead worker's working list and
// counted as a redelivery each time; past the poison limit (5 earlier
// deliveries) the next worker sends it to the dead set as
// Onceler::Poison instead of running it again.
func TestSidekiqPoison(t *testing.T) {
	t.Parallel()
	e := newSkEnv(t)
	op := testkit.Name("skpoison")
	jids := e.push(creditJob(op))
	ctx := context.Background()
	for kill := 1; kill <= 6; kill++ {
		w := e.startWorker(skWorkerOptions{CrashAt: "after_claim", CrashTask: demo.TaskCredit, Concurrency: 1, Prefetch: 1, MayCrash: true})
		id := w.identity(t)
		if !testkit.Eventually(60*time.Second, w.Exited) || !w.Crashed() {
			t.Fatalf("run %d: the worker did not crash: %s", kill, w.LogTail(3000))
		}
		testkit.WaitFor(t, "the killed worker's heartbeat to expire", time.Minute, func() bool {
			n, err := e.rdb.Exists(ctx, id).Result()
			return err == nil && n == 0
		})
	}
	e.startWorker(skWorkerOptions{})
	var dead []skEntry
	testkit.WaitFor(t, "the job in the dead set", time.Minute, func() bool {
		e.ruby(&dead, "dead", nil)
		return len(dead) == 1
	})
	if d := dead[0]; d.JID != jids[0] || d.Item["error_class"] != "Onceler::Poison" {
		t.Errorf("dead set %+v, want the job as Onceler::Poison", d)
	}
	if n := len(ledgerOrder(t, e, op)); n != 0 {
		t.Errorf("the poison job's effect: %d, want 0", n)
	}
	testkit.WaitFor(t, "Redis idle", 10*time.Second, e.idle)
}

// TestSidekiqIdempotencyKey: a job's idempotency_key is the operation key,
// over the task's Key of its arguments: two jobs with the same key run
// once; the same arguments under another key are another operation.
func TestSidekiqIdempotencyKey(t *testing.T) {
	t.Parallel()
	e := newSkEnv(t)
	e.startWorker(skWorkerOptions{})
	entry := testkit.Name("skkey")
	k1, k2 := entry+"-k1", entry+"-k2"
	withKey := func(k string) map[string]any {
		j := creditJob(entry)
		j["idempotency_key"] = k
		return j
	}
	e.push(withKey(k1), withKey(k1), withKey(k2))
	ctx := context.Background()
	testkit.WaitFor(t, "every job settled", time.Minute, func() bool {
		for _, k := range []string{k1, k2} {
			if rec, err := e.store.Get(ctx, demo.TaskCredit, k); err != nil || rec.Status != idempotency.StatusCompleted {
				return false
			}
		}
		return e.idle()
	})
	if n := len(ledgerOrder(t, e, entry)); n != 2 {
		t.Errorf("%d ledger rows for entry %s, want 2 (one per idempotency key)", n, entry)
	}
	if _, err := e.store.Get(ctx, demo.TaskCredit, entry); !errors.Is(err, idempotency.ErrNotFound) {
		t.Errorf("record under the task's own key: %v, want none (the job's idempotency_key wins)", err)
	}
}
