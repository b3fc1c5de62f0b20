package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testkit"
	"github.com/onceler/onceler/tasks"
)

// TestSidekiqSoak pushes 10,000 Sidekiq jobs (ONCELER_SOAK_TASKS to
// change) with Ruby Sidekiq's Client.push_bulk, in batches over about a
// minute, across the demo tasks of the Sidekiq replay suite (a sixth of
// them a second job for an operation already pushed, as a producer whose
// call timed out), to two onceler worker --sidekiq processes, one of which
// is killed (kill -9) every few seconds and restarted, and restarts Redis
// (a private server, append-only, so that it keeps the jobs) once in the
// middle, down for two seconds. A killed worker's jobs go back to the queue
// when a live worker's recovery (at its start and every 30 s) finds its
// heartbeat expired. Operations held by the policy (an email whose worker died
// mid-send) are resolved as a person would. At the end every operation has
// exactly one effect and a completed record, and no job is left in the
// queues, the working lists, the retry, schedule or dead sets. It prints a
// table of what it did. Runs with ONCELER_FAULT_TESTS=1.
func TestSidekiqSoak(t *testing.T) {
	faultTests(t)
	total := 10000
	if v, err := strconv.Atoi(os.Getenv("ONCELER_SOAK_TASKS")); err == nil && v > 0 {
		total = v
	}
	rs := startRedisServer(t)
	e := newSkEnvAt(t, rs.addr())
	ctx := context.Background()
	opts := skWorkerOptions{Concurrency: 8, Prefetch: 16}
	workers := []*skWorker{e.startWorker(opts), e.startWorker(opts)}

	// The operations and their jobs: credit half of them, charge and
	// email the rest; a sixth of the jobs are for an operation pushed
	// before (a new jid).
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 11))
	targets := skTargets()
	weights := []int{0, 0, 0, 1, 1, 2} // credit, charge, email
	prefix := testkit.Name("sks")
	var ops []*soakOp
	type job struct {
		tg   int
		args []any
	}
	var jobs []job
	for len(jobs) < total {
		if len(ops) > 10 && rng.IntN(6) == 0 {
			o := ops[rng.IntN(len(ops))]
			o.sends++
			jobs = append(jobs, job{o.tg, targets[o.tg].args(o.key)})
			continue
		}
		o := &soakOp{tg: weights[rng.IntN(len(weights))], key: fmt.Sprintf("%s-%d", prefix, len(ops)), sends: 1}
		ops = append(ops, o)
		jobs = append(jobs, job{o.tg, targets[o.tg].args(o.key)})
	}
	// Batches of about 500 jobs, pushed every 3 s.
	nb := max(1, (len(jobs)+499)/500)
	batches := make([][]byte, nb)
	for b := range nb {
		byClass := map[int][][]any{}
		for _, j := range jobs[b*len(jobs)/nb : (b+1)*len(jobs)/nb] {
			byClass[j.tg] = append(byClass[j.tg], j.args)
		}
		var bulk []map[string]any
		for tg, args := range byClass {
			bulk = append(bulk, map[string]any{"class": targets[tg].task, "queue": e.queue, "args": args})
		}
		var err error
		if batches[b], err = json.Marshal(bulk); err != nil {
			t.Fatal(err)
		}
	}

	var restarts int
	var redisDown time.Duration
	settled := func() bool { return skSoakSettled(t, e, prefix, len(ops)) }
	d := &soakDriver{t: t, rng: rng, batches: nb, sent: "jobs pushed",
		send: func(b int) int {
			var n int
			e.rubyIn(&n, "push_bulk", nil, batches[b])
			return n
		},
		startWorker: func() *skWorker { return e.startWorker(opts) },
		settled:     settled,
		count:       func() int { return soakCount(&e.queueEnv, prefix) },
		ops:         len(ops),
	}
	// Redis restarted once, when half the batches are pushed.
	d.fault = func(sent int) bool {
		if restarts != 0 || sent < nb/2 {
			return false
		}
		redisDown = rs.restart(t)
		t.Logf("%s: restarted Redis (SHUTDOWN, append-only file kept) in %s", time.Since(d.start).Round(time.Second), redisDown.Round(time.Millisecond))
		restarts++
		return true
	}
	start, pushed, kills := d.run(workers, 150*time.Second)
	drained := time.Since(start)
	if !settled() {
		t.Errorf("after %s: jobs or claims left (Redis idle %v)", drained.Round(time.Second), e.idle())
	}
	if pushed != len(jobs) {
		t.Errorf("Sidekiq pushed %d jobs, want %d", pushed, len(jobs))
	}

	// Held operations (an email whose worker was killed between its claim
	// and its completion), resolved as a person would: completed if the
	// email went out, else pushed again by onceler resolve --retry.
	held, resent := 0, 0
	for _, o := range ops {
		tg := targets[o.tg]
		if tg.policy != tasks.PolicyHold {
			continue
		}
		rec, err := e.store.Get(ctx, tg.task, o.key)
		if err != nil || rec.Status != idempotency.StatusHeld {
			continue
		}
		held++
		n, err := tg.effects(ctx, e.pool, o.key)
		if err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			if err := e.store.ResolveCompleted(ctx, tg.task, o.key, nil); err != nil {
				t.Fatalf("resolve completed: %v", err)
			}
			continue
		}
		cmd := exec.Command(oncelerBin, "resolve", "--retry", "--sidekiq", e.redisURL, tg.task, o.key)
		cmd.Env = append(os.Environ(), "ONCELER_DATABASE_URL="+e.dbURL, "ONCELER_SCHEMA="+e.schema)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("onceler resolve --retry: %v: %s", err, out)
		}
		resent++
	}
	if resent > 0 {
		testkit.WaitFor(t, "the jobs pushed again run", time.Minute, settled)
	}
	time.Sleep(500 * time.Millisecond)
	e.stopAll()

	// Every operation: one effect, a completed record; Redis empty.
	per := soakOutcome(t, &e.queueEnv, targets, prefix, ops)
	var dead []map[string]any
	e.ruby(&dead, "dead", nil)
	if !e.idle() || len(dead) != 0 {
		t.Errorf("Redis not empty at the end: idle %v, %d jobs in the dead set", e.idle(), len(dead))
	}
	if n, err := e.store.StaleClaims(ctx); err != nil || n != 0 {
		t.Errorf("stale claims: %d (err %v), want 0", n, err)
	}
	var answered int64
	stats, err := e.store.Repeats(ctx, start.Add(-time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	for _, st := range stats {
		answered += st.Duplicates
	}
	redelivered := 0
	for _, w := range e.all() {
		redelivered += skRecovered(w.Log())
	}

	var b strings.Builder
	fmt.Fprintf(&b, "\nsidekiq soak: %d jobs pushed by Ruby Sidekiq (push_bulk, %d batches), %d operations, %d jobs for an operation pushed before,\n"+
		"through 2 workers in %s (%.0f jobs/s)\n", pushed, nb, len(ops), len(jobs)-len(ops), drained.Round(time.Second), float64(len(jobs))/drained.Seconds())
	fmt.Fprintf(&b, "faults: %d kill -9 (each restarted), %d Redis restart (down %s)\n", kills, restarts, redisDown.Round(time.Millisecond))
	fmt.Fprintf(&b, "redeliveries: %d jobs of killed workers recovered to their queue; %d deliveries answered from the record (duplicates);\n"+
		"%d emails held by the policy (worker killed mid-send), %d of them pushed again by onceler resolve --retry\n\n", redelivered, answered, held, resent)
	soakReport(t, "sidekiq", b.String(), "jobs", targets, per)
	if kills == 0 || restarts == 0 {
		t.Errorf("sidekiq soak: %d kills and %d Redis restarts, want some of each", kills, restarts)
	}
}

// skSoakSettled reports whether Redis holds no job and every one of the
// n operations under prefix has a record that is not claimed.
func skSoakSettled(t *testing.T, e *skEnv, prefix string, n int) bool {
	t.Helper()
	return e.idle() && soakCount(&e.queueEnv, prefix) == n
}

// skRecovered sums the jobs a worker's log says it recovered from dead
// processes' working lists.
func skRecovered(log string) int {
	n := 0
	for _, line := range strings.Split(log, "\n") {
		if !strings.Contains(line, "recovered to their queues") && !strings.Contains(line, "requeued") {
			continue
		}
		var m struct {
			Jobs int `json:"jobs"`
		}
		if json.Unmarshal([]byte(line), &m) == nil {
			n += m.Jobs
		}
	}
	return n
}

// redisServer is a private redis-server started by a test on a free port,
// append-only in a temporary directory, so that a restart keeps its keys
// (the shared server on 6379 is left alone).
type redisServer struct {
	port int
	dir  string
	bin  string
	cmd  *exec.Cmd
}

func startRedisServer(t *testing.T) *redisServer {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		if os.Getenv("ONCELER_REQUIRE_SERVICES") != "" {
			t.Fatalf("redis-server not installed: %v", err)
		}
		t.Skipf("redis-server not installed: %v", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	_ = ln.Close()
	s := &redisServer{port: port, dir: t.TempDir(), bin: bin}
	s.start(t)
	t.Cleanup(s.kill)
	return s
}

func (s *redisServer) addr() string { return "127.0.0.1:" + strconv.Itoa(s.port) }

func (s *redisServer) start(t *testing.T) {
	t.Helper()
	s.cmd = exec.Command(s.bin, "--port", strconv.Itoa(s.port), "--bind", "127.0.0.1", "--save", "",
		"--appendonly", "yes", "--appendfsync", "everysec", "--dir", s.dir, "--logfile", filepath.Join(s.dir, "redis.log"))
	if err := s.cmd.Start(); err != nil {
		t.Fatalf("start redis-server: %v", err)
	}
	testkit.WaitFor(t, "redis-server to load its data and listen", 30*time.Second, func() bool {
		out, err := exec.Command("redis-cli", "-p", strconv.Itoa(s.port), "PING").Output()
		return err == nil && strings.TrimSpace(string(out)) == "PONG"
	})
}

// restart stops the server with SHUTDOWN (which writes the append-only
// file out), waits two seconds and starts it again on the same port and
// directory; returns how long it was down.
func (s *redisServer) restart(t *testing.T) time.Duration {
	t.Helper()
	began := time.Now()
	_ = exec.Command("redis-cli", "-p", strconv.Itoa(s.port), "SHUTDOWN").Run()
	done := make(chan error, 1)
	go func() { done <- s.cmd.Wait() }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("redis-server did not stop within 30s of SHUTDOWN")
	}
	s.cmd = nil
	time.Sleep(2 * time.Second) // down long enough for the workers to meet it
	s.start(t)
	return time.Since(began)
}

// kill ends the server with SIGKILL.
func (s *redisServer) kill() {
	if s.cmd == nil || s.cmd.Process == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Wait()
	s.cmd = nil
}
