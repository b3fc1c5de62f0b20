package tasks

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/testkit"
)

// Hostile inputs to the worker's run-time commands (control_cmds.go).

// TestSettingsHideBackendPasswordInQuery: a django-db or Redis result
// backend URL whose password is in the query (pgx and redisOptions read
// ?password=), with or without a user before '@', must not show the password in conf or report
// (Settings), as the backend's own messages do not.
func TestSettingsHideBackendPasswordInQuery(t *testing.T) {
	e := newEnv(t)
	reg := NewRegistry()
	if err := Register(reg, Task[chargeArgs]{Name: "t.pure", Run: noRun}); err != nil {
		t.Fatal(err)
	}
	for _, backend := range []string{
		"django-db+postgresql://127.0.0.1:5432/test?user=root&password=S3cretPw",
		"django-db+postgresql://root@127.0.0.1:5432/test?password=S3cretPw",
		"redis://127.0.0.1:6379/0?password=S3cretPw",
	} {
		cfg := e.config()
		cfg.ResultBackend = backend
		w, err := NewWorker(reg, cfg)
		if err != nil {
			t.Fatalf("%s: %v", backend, err)
		}
		for _, all := range []bool{false, true} {
			if got := w.Settings(all)["result_backend"]; strings.Contains(celeryproto.Repr(got), "S3cretPw") {
				t.Errorf("Settings(%v) result_backend = %v: the password shows", all, got)
			}
		}
		w.closeBackend()
	}
}

// TestRateLimitTinyRate: a rate limit so low that its interval overflows a
// time.Duration ("1e-12/s": one task every ~31,700 years) must hold the
// second delivery, not let every delivery start at once.
func TestRateLimitTinyRate(t *testing.T) {
	e := newEnv(t)
	var mu sync.Mutex
	started := 0
	run := func(_ context.Context, _ *Call, _ chargeArgs) (any, error) {
		mu.Lock()
		defer mu.Unlock()
		started++
		return "ok", nil
	}
	reg := NewRegistry()
	if err := Register(reg, Task[chargeArgs]{Name: "t.slow", Run: run}); err != nil {
		t.Fatal(err)
	}
	cfg := e.config()
	cfg.Concurrency, cfg.Prefetch = 2, 8
	cfg.Grace = 2 * time.Second
	r := e.start(reg, cfg)
	if err := r.w.SetRateLimit("t.slow", "1e-12/s"); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		e.publish(payMessage("t.slow", i, "tiny", ""))
	}
	testkit.WaitFor(t, "the first start", 10*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return started >= 1
	})
	time.Sleep(2 * time.Second)
	mu.Lock()
	n := started
	mu.Unlock()
	if n > 1 {
		t.Errorf("rate limit 1e-12/s: %d tasks started within 2 s", n)
	}
	// the deliveries held by the rate limit go back to the queue at shutdown
	r.stop(t)
	if n == 1 {
		if d := e.queueDepth(e.queue); d != 2 {
			t.Errorf("after shutdown, %d messages in the queue, want the 2 held by the rate limit", d)
		}
	}
}

// TestRateLimitAfterReconnect: deliveries waiting for a rate limit when
// the consuming connection is lost are redelivered; their lost reservations
// must not stay in the token bucket (Celery clears the pending ones on a
// connection loss), or the redelivered ones wait behind starts that never
// happen (and, repeated, past the broker's consumer timeout). At 2/s, 24
// tasks (11.5 s of starts) with the connection lost after the second start
// must all start within about 14 s of the first.
func TestRateLimitAfterReconnect(t *testing.T) {
	e := newEnv(t)
	var mu sync.Mutex
	starts := map[string]time.Time{}
	run := func(_ context.Context, c *Call, _ chargeArgs) (any, error) {
		mu.Lock()
		defer mu.Unlock()
		if _, ok := starts[c.Message.ID]; !ok {
			starts[c.Message.ID] = time.Now()
		}
		return "ok", nil
	}
	reg := NewRegistry()
	if err := Register(reg, Task[chargeArgs]{Name: "t.rated", Run: run, RateLimit: "2/s"}); err != nil {
		t.Fatal(err)
	}
	cfg := e.config()
	cfg.Concurrency, cfg.Prefetch = 2, 32
	cfg.Grace = 2 * time.Second
	e.start(reg, cfg)
	const n = 24
	for i := range n {
		e.publish(payMessage("t.rated", i, "rc", ""))
	}
	count := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(starts)
	}
	testkit.WaitFor(t, "two starts", 10*time.Second, func() bool { return count() >= 2 })
	pids := testkit.ConnectionPIDs(t, cfg.Broker.Name)
	testkit.CloseConnections(t, pids)
	testkit.WaitFor(t, "all starts", 60*time.Second, func() bool { return count() == n })
	mu.Lock()
	defer mu.Unlock()
	first, last := time.Now(), time.Time{}
	for _, s := range starts {
		if s.Before(first) {
			first = s
		}
		if s.After(last) {
			last = s
		}
	}
	if span := last.Sub(first); span > 14*time.Second {
		t.Errorf("rate limit 2/s, connection lost after the first starts: %d tasks took %v from the first start to the last (want ≈ 11.5-13 s: the lost reservations held the redelivered ones back)", n, span)
	}
}

// TestRateLimitWaitBoundedByMaxHold: a delivery waiting for its task's
// rate limit waits unacknowledged in the worker's timers; like one held
// for its ETA it must not stay unacknowledged past Config.MaxHold (kept
// below RabbitMQ's consumer_timeout, 30 min by default, past which the
// broker closes the channel and every delivery on it, running tasks'
// included, returns to the queue). rate_limit 1/h with two deliveries
// otherwise holds the second one for an hour.
func TestRateLimitWaitBoundedByMaxHold(t *testing.T) {
	e := newEnv(t)
	reg := NewRegistry()
	if err := Register(reg, Task[chargeArgs]{Name: "t.rated", Run: noRun}); err != nil {
		t.Fatal(err)
	}
	cfg := e.config()
	cfg.MaxHold = 700 * time.Millisecond
	cfg.Grace = 2 * time.Second
	r := e.start(reg, cfg)
	if err := r.w.SetRateLimit("t.rated", "20/m"); err != nil { // one start every 3 s
		t.Fatal(err)
	}
	for i := range 2 {
		e.publish(payMessage("t.rated", i, "hold", ""))
	}
	var oldest time.Duration
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		r.w.mu.Lock()
		for j := range r.w.timers {
			if j.d.stale() {
				continue
			}
			oldest = max(oldest, time.Since(j.received))
		}
		r.w.mu.Unlock()
		time.Sleep(50 * time.Millisecond)
	}
	if oldest > cfg.MaxHold+time.Second {
		t.Errorf("a delivery waited %v unacknowledged for its rate limit, past MaxHold %v", oldest.Round(time.Millisecond), cfg.MaxHold)
	}
}

// TestInspectReservedWhileDecoding: inspect reserved (Worker.Reserved, from
// the remote-control goroutine) while the task goroutines decode the
// deliveries it lists must not race with them (go test -race): the decode
// stage sets the job's message without the worker's lock that Reserved
// reads it under.
func TestInspectReservedWhileDecoding(t *testing.T) {
	e := newEnv(t)
	var mu sync.Mutex
	ran := 0
	run := func(_ context.Context, _ *Call, _ chargeArgs) (any, error) {
		mu.Lock()
		defer mu.Unlock()
		ran++
		return "ok", nil
	}
	reg := NewRegistry()
	if err := Register(reg, Task[chargeArgs]{Name: "t.quick", Run: run}); err != nil {
		t.Fatal(err)
	}
	cfg := e.config()
	cfg.Concurrency, cfg.Prefetch = 4, 64
	r := e.start(reg, cfg)
	const n = 300
	for i := range n {
		e.publish(payMessage("t.quick", i, "insp", ""))
	}
	done := func() bool {
		mu.Lock()
		defer mu.Unlock()
		return ran >= n
	}
	listed := 0
	deadline := time.Now().Add(60 * time.Second)
	for !done() && time.Now().Before(deadline) {
		for _, ti := range r.w.Reserved() {
			if ti.Name != "" {
				listed++
			}
		}
	}
	if !done() {
		t.Fatal("tasks not done")
	}
	t.Logf("listed %d decoded reserved tasks", listed)
}
