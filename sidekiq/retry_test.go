package sidekiq

import (
	"context"
	"encoding/json"
	"reflect"
	"sort"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

func TestRetryAsSidekiqReadsIt(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	var jid string
	e.ruby("push", map[string]any{"class": "FlakyWorker", "args": []any{1}, "queue": "main", "backtrace": true, "retry_queue": "retries"}, &jid)
	c := e.client(Config{Queues: []string{"main", "retries"}, PollInterval: 100 * time.Millisecond})

	j := fetch(t, c, 5*time.Second)
	bt := []string{"app/workers/flaky_worker.rb:3:in `perform'", "lib/runner.rb:9:in `call'"}
	before := float64(time.Now().UnixNano()) / 1e9
	out, err := c.Retry(ctx, j, "Net::ReadTimeout", "timed out", bt)
	if err != nil || out != Retried {
		t.Fatalf("Retry: %v, outcome %v", err, out)
	}
	if n := e.llen(WorkingKey(c.Identity(), "main")); n != 0 {
		t.Fatalf("working list holds %d after Retry", n)
	}
	var retries []sortedEntry
	e.ruby("retries", nil, &retries)
	if len(retries) != 1 {
		t.Fatalf("retry set %+v", retries)
	}
	r := retries[0]
	it := r.Item
	if r.JID != jid || it["retry_count"] != jsonNum(0) || it["error_class"] != "Net::ReadTimeout" ||
		it["error_message"] != "timed out" || it["queue"] != "retries" || it["class"] != "FlakyWorker" {
		t.Fatalf("retry entry %+v", it)
	}
	failedAt := num(t, it["failed_at"])
	if failedAt < before-1 || failedAt > before+5 {
		t.Fatalf("failed_at %v, now %v", failedAt, before)
	}
	if _, ok := it["retried_at"]; ok {
		t.Fatalf("retried_at at the first failure: %v", it)
	}
	if !reflect.DeepEqual(r.ErrorBacktrace, bt) {
		t.Fatalf("backtrace as Sidekiq reads it: %q", r.ErrorBacktrace)
	}
	// Due in 0**4 + 15 + rand(10)*1 seconds.
	if s := num(t, r.Score) - failedAt; s < 14.9 || s > 24.1 {
		t.Fatalf("retry due %v s after the failure", s)
	}

	// Make it due: the poller moves it to its retry_queue.
	if err := e.rdb.ZAdd(ctx, "retry", redis.Z{Score: 1, Member: r.Value}).Err(); err != nil {
		t.Fatal(err)
	}
	e.run(c, nil)
	j2 := fetch(t, c, 10*time.Second)
	if j2.JID != jid || j2.Queue != "retries" || j2.RetryCount != 0 {
		t.Fatalf("retried job %+v", j2)
	}
	if e.rdb.ZCard(ctx, "retry").Val() != 0 {
		t.Fatal("retry set not emptied")
	}
	before = float64(time.Now().UnixNano()) / 1e9
	if out, err := c.Retry(ctx, j2, "Net::ReadTimeout", "again", bt); err != nil || out != Retried {
		t.Fatalf("second Retry: %v %v", err, out)
	}
	e.ruby("retries", nil, &retries)
	if len(retries) != 1 {
		t.Fatalf("retry set %+v", retries)
	}
	it = retries[0].Item
	if it["retry_count"] != jsonNum(1) || num(t, it["failed_at"]) != failedAt || it["error_message"] != "again" {
		t.Fatalf("second retry entry %+v", it)
	}
	retriedAt := num(t, it["retried_at"])
	if retriedAt < before-1 || retriedAt > before+5 {
		t.Fatalf("retried_at %v", retriedAt)
	}
	// 1**4 + 15 + rand(10)*2.
	if s := num(t, retries[0].Score) - retriedAt; s < 15.9 || s > 34.1 {
		t.Fatalf("second retry due %v s after", s)
	}
}

func jsonNum(i int) any { return json.Number(strconv.Itoa(i)) }

func TestRetryExhaustedAndRetryFalse(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	var jids []string
	e.ruby("push_many", []map[string]any{
		{"class": "A", "args": []any{}, "queue": "q", "retry": 2, "retry_count": 1},                // third failure of retry: 2
		{"class": "B", "args": []any{}, "queue": "q", "retry": 0},                                  // no retries at all
		{"class": "C", "args": []any{}, "queue": "q", "retry": false},                              // dropped
		{"class": "D", "args": []any{}, "queue": "q", "retry_count": 24},                           // default 25 reached
		{"class": "E", "args": []any{}, "queue": "q", "retry": 1, "retry_count": 0, "dead": false}, // exhausted, not kept
		{"class": "F", "args": []any{}, "queue": "q", "retry_count": 23, "retry": true},            // 24 < 25: retried
	}, &jids)
	c := e.client(Config{Queues: []string{"q"}})
	want := map[string]RetryOutcome{"A": Dead, "B": Dead, "C": Discarded, "D": Dead, "E": Discarded, "F": Retried}
	for range 6 {
		j := fetch(t, c, 5*time.Second)
		out, err := c.Retry(ctx, j, "RuntimeError", "boom "+j.Class, nil)
		if err != nil {
			t.Fatal(err)
		}
		if out != want[j.Class] {
			t.Errorf("%s: outcome %v, want %v", j.Class, out, want[j.Class])
		}
	}
	if n := e.llen(WorkingKey(c.Identity(), "q")); n != 0 {
		t.Fatalf("working list holds %d", n)
	}
	var dead, retries []sortedEntry
	e.ruby("dead", nil, &dead)
	e.ruby("retries", nil, &retries)
	var deadClasses []string
	for _, d := range dead {
		deadClasses = append(deadClasses, d.Klass)
		if d.Item["error_message"] != "boom "+d.Klass || d.Item["error_class"] != "RuntimeError" {
			t.Errorf("dead entry %+v", d.Item)
		}
	}
	sort.Strings(deadClasses)
	if !reflect.DeepEqual(deadClasses, []string{"A", "B", "D"}) {
		t.Fatalf("dead set holds %v", deadClasses)
	}
	if len(retries) != 1 || retries[0].Klass != "F" || retries[0].Item["retry_count"] != jsonNum(24) {
		t.Fatalf("retry set %+v", retries)
	}
	var stats map[string]any
	e.ruby("stats", nil, &stats)
	if stats["dead_size"] != jsonNum(3) || stats["retry_size"] != jsonNum(1) {
		t.Fatalf("stats %v", stats)
	}
}

func TestKillAndDeadSetBounds(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	pushMany(e, "q", 3, "Bad")
	c := e.client(Config{Queues: []string{"q"}, DeadMaxJobs: 3})
	// An entry older than the dead timeout is trimmed by the next kill.
	old := time.Now().Add(-181 * 24 * time.Hour)
	if err := e.rdb.ZAdd(ctx, "dead", redis.Z{Score: timeFloat(old), Member: `{"class":"Old","args":[],"jid":"old"}`}).Err(); err != nil {
		t.Fatal(err)
	}
	var killed []string
	for range 3 {
		j := fetch(t, c, 5*time.Second)
		if err := c.Kill(ctx, j, "ArgumentError", "bad input"); err != nil {
			t.Fatal(err)
		}
		killed = append(killed, j.JID)
	}
	if n := e.llen(WorkingKey(c.Identity(), "q")); n != 0 {
		t.Fatalf("working list holds %d", n)
	}
	var dead []sortedEntry
	e.ruby("dead", nil, &dead)
	// dead_max_jobs 3: as DeadSet#kill, ZREMRANGEBYRANK 0 -3 keeps 2.
	if len(dead) != 2 {
		t.Fatalf("dead set %+v", dead)
	}
	got := map[string]bool{}
	for _, d := range dead {
		got[d.JID] = true
		if d.Item["error_class"] != "ArgumentError" || d.Item["error_message"] != "bad input" || d.Item["failed_at"] == nil {
			t.Errorf("dead entry %+v", d.Item)
		}
	}
	if !got[killed[1]] || !got[killed[2]] {
		t.Fatalf("dead set holds %v, want the newest of %v", got, killed)
	}
}

func TestScheduledJobsArrive(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	var jid string
	e.ruby("perform_in", map[string]any{"seconds": 1, "queue": "later", "args": []any{"x"}}, &jid)
	var sched []sortedEntry
	e.ruby("scheduled", nil, &sched)
	if len(sched) != 1 || sched[0].JID != jid {
		t.Fatalf("scheduled set %+v", sched)
	}
	c := e.client(Config{Queues: []string{"later"}, PollInterval: 100 * time.Millisecond})
	e.run(c, nil)
	start := time.Now()
	j := fetch(t, c, 10*time.Second)
	if j.JID != jid || j.Class != "HardWorker" || !reflect.DeepEqual(j.Args, []any{"x"}) || j.Fields["enqueued_at"] == nil {
		t.Fatalf("scheduled job %+v", j)
	}
	t.Logf("scheduled job arrived after %v", time.Since(start))

	// Schedule sends a fetched job back for later, out of the working list.
	at := time.Now().Add(4 * time.Second) // later than the Ruby read below
	if err := c.Schedule(ctx, j, at); err != nil {
		t.Fatal(err)
	}
	if n := e.llen(WorkingKey(c.Identity(), "later")); n != 0 {
		t.Fatalf("working list holds %d", n)
	}
	e.ruby("scheduled", nil, &sched)
	if len(sched) != 1 || sched[0].JID != jid {
		t.Fatalf("scheduled set %+v", sched)
	}
	j2 := fetch(t, c, 10*time.Second)
	// The schedule is wall-clock time, as in Sidekiq: compare wall clocks
	// (Round(0) drops the monotonic reading, which a step of the system
	// clock does not move). The scheduler compares scores as float64
	// seconds (timeFloat), which round by under a microsecond.
	if now := time.Now().Round(0); now.Before(at.Round(0).Add(-time.Microsecond)) {
		t.Fatalf("scheduled job arrived at %v, before its time %v", now, at.Round(0))
	}
	if j2.JID != jid {
		t.Fatalf("rescheduled job %+v", j2)
	}
	if err := c.Done(ctx, j2); err != nil {
		t.Fatal(err)
	}
}

func TestPollersDoNotDoubleEnqueue(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	const n = 300
	past := float64(time.Now().Add(-time.Minute).Unix())
	items := make([]map[string]any, n)
	for i := range items {
		items[i] = map[string]any{"class": "W", "args": []any{i}, "queue": "due", "at": past}
	}
	var jids []string
	e.ruby("push_many", items, &jids)
	// Half of them to the retry set, as retries.
	members, err := e.rdb.ZRange(ctx, "schedule", 0, n/2-1).Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range members {
		if err := e.rdb.ZRem(ctx, "schedule", m).Err(); err != nil {
			t.Fatal(err)
		}
		if err := e.rdb.ZAdd(ctx, "retry", redis.Z{Score: past, Member: m}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	clients := make([]*Client, 4)
	for i := range clients {
		clients[i] = e.client(Config{Queues: []string{"due"}})
	}
	var wg sync.WaitGroup
	moved := make([]int, len(clients))
	for i, c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 3 {
				m, err := c.EnqueueDue(ctx)
				if err != nil {
					t.Error(err)
					return
				}
				moved[i] += m
			}
		}()
	}
	wg.Wait()
	total := 0
	for _, m := range moved {
		total += m
	}
	queued := e.lrange("queue:due")
	if total != n || len(queued) != n {
		t.Fatalf("moved %v (total %d), queue holds %d, want %d", moved, total, len(queued), n)
	}
	seen := map[string]bool{}
	for _, raw := range queued {
		j, err := Decode(raw, "due")
		if err != nil {
			t.Fatal(err)
		}
		if seen[j.JID] {
			t.Fatalf("job %s enqueued twice", j.JID)
		}
		seen[j.JID] = true
		if _, ok := j.Fields["at"]; ok || j.Fields["enqueued_at"] == nil {
			t.Fatalf("enqueued job %s", raw)
		}
	}
	for _, jid := range jids {
		if !seen[jid] {
			t.Fatalf("job %s not enqueued", jid)
		}
	}
	t.Logf("moved per poller: %v", moved)
	if !e.rdb.SIsMember(ctx, "queues", "due").Val() {
		t.Fatal(`queue not in "queues"`)
	}
}
