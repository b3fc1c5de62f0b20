package integration

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/internal/testkit"
)

// TestSoak runs 20,000 demo tasks (ONCELER_SOAK_TASKS to change) of every
// mode, a fifth of them duplicates and one in 25 hostile input (a result
// with a NUL, a task that swallows its statement's error, a deferred
// constraint failing at commit, a 16 kB key), published over two minutes through 3
// worker processes while it
// kills -9 a random worker every few seconds (and restarts it), resets the
// workers' broker connections once and restarts PostgreSQL (a private
// server) once. At the end every operation must have exactly the effects
// its mode guarantees, every caller a result (except operations held for a
// person), the queue and quarantine empty, and no stale claim. It prints a
// table of what it did and what it found. Runs with ONCELER_FAULT_TESTS=1.
func TestSoak(t *testing.T) {
	faultTests(t)
	total := 20000
	if v, err := strconv.Atoi(os.Getenv("ONCELER_SOAK_TASKS")); err == nil && v > 0 {
		total = v
	}
	pg := startPostgres(t)
	e := replay.NewEnv(t, replay.Config{Binary: ownBin, DatabaseURL: pg.url})
	migrate(t, e)
	opts := replay.WorkerOptions{Concurrency: 8, Prefetch: 32}
	workers := []*replay.Worker{e.StartWorker(opts), e.StartWorker(opts), e.StartWorker(opts)}

	// The calls: a fifth re-send an earlier operation (new task id, as a
	// client retrying), some of those the very same message again.
	wl := newWorkload(e)
	wl.outsideDown = true
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7))
	kinds := []string{demo.TaskCredit, demo.TaskCredit, demo.TaskCredit, demo.TaskCharge, demo.TaskCharge,
		demo.TaskEmail, "replay.notify", "replay.notify", demo.TaskAdd, demo.TaskCredit}
	var msgs []*celeryproto.Message
	for i := 0; len(msgs) < total; i++ {
		if len(wl.ops) > 10 && rng.IntN(5) == 0 {
			o := wl.ops[rng.IntN(len(wl.ops))]
			if rng.IntN(4) == 0 {
				msgs = append(msgs, o.msgs[0]) // the same message again
				continue
			}
			msgs = append(msgs, wl.add(o.task, o.op))
			continue
		}
		if rng.IntN(25) == 0 {
			// Hostile input, one call in 25: a result the record cannot keep
			// as it is, a task that swallows its statement's error, a
			// deferred constraint that fails at commit, a 16 kB key.
			switch k := rng.IntN(4); k {
			case 3:
				msgs = append(msgs, wl.add("replay.notify", strings.Repeat("k", 16<<10)+wl.op("long", i)))
			default:
				msgs = append(msgs, wl.add([]string{"replay.nul", "replay.swallow", "replay.deferred"}[k], wl.op("hostile", i)))
			}
			continue
		}
		msgs = append(msgs, wl.add(kinds[rng.IntN(len(kinds))], wl.op("soak", i)))
	}
	dups := len(msgs) - len(wl.ops)
	again := len(msgs) - len(wl.ids())

	start := time.Now()
	var published atomic.Int64
	var pubErr atomic.Value
	stopPub := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	// Paced over two minutes, so that the faults land mid-stream.
	pace := 120 * time.Second / time.Duration(len(msgs))
	go func() {
		defer wg.Done()
		for i, m := range msgs {
			wait := time.NewTimer(time.Until(start.Add(time.Duration(i) * pace)))
			select {
			case <-stopPub:
				wait.Stop()
				return
			case <-wait.C:
			}
			if err := e.TryPublish(context.Background(), m); err != nil {
				pubErr.Store(err)
				return
			}
			published.Add(1)
		}
	}()
	defer func() {
		close(stopPub)
		wg.Wait()
	}()

	// Chaos until every call is answered (or the time is up).
	var kills, resets, restarts int
	deadline := start.Add(6 * time.Minute)
	nextKill := time.Now().Add(3 * time.Second)
	done := func() bool { return published.Load() == int64(len(msgs)) && wl.settled() }
	lastLog := time.Now()
	for time.Now().Before(deadline) {
		if done() {
			break
		}
		if err, _ := pubErr.Load().(error); err != nil {
			t.Fatalf("publish: %v", err)
		}
		progress := float64(wl.answered()) / float64(len(wl.ids()))
		sent := float64(published.Load()) / float64(len(msgs))
		if time.Since(lastLog) > 10*time.Second {
			t.Logf("%s: %d published, %.0f%% answered, %d kills", time.Since(start).Round(time.Second), published.Load(), 100*progress, kills)
			lastLog = time.Now()
		}
		switch {
		case resets == 0 && sent > 0.3:
			n := closeWorkerConnections(t, workers...)
			t.Logf("%s: reset %d broker connections of the workers", time.Since(start).Round(time.Second), n)
			resets++
		case restarts == 0 && sent > 0.6:
			took := pg.restart(t, "fast")
			t.Logf("%s: restarted PostgreSQL (fast) in %s", time.Since(start).Round(time.Second), took.Round(time.Millisecond))
			restarts++
		case time.Now().After(nextKill) && sent < 1:
			i := rng.IntN(len(workers))
			workers[i].Kill()
			kills++
			workers[i] = e.StartWorker(replay.WorkerOptions{Concurrency: 8, Prefetch: 32, NoWait: true})
			nextKill = time.Now().Add(time.Duration(2000+rng.IntN(3000)) * time.Millisecond)
		}
		time.Sleep(200 * time.Millisecond)
	}
	elapsed := time.Since(start)
	if !done() {
		t.Errorf("after %s: %d of %d calls answered, %d published", elapsed.Round(time.Second), wl.answered(), len(msgs), published.Load())
	}
	wl.stopWorkers()
	byTask := wl.checkByTask(t)

	var b strings.Builder
	fmt.Fprintf(&b, "\nsoak: %d messages, %d operations, %d duplicates (%d re-sent with a new task id, %d the same message again),\n"+
		"through 3 workers in %s (%.0f messages/s)\n",
		len(msgs), len(wl.ops), dups, dups-again, again, elapsed.Round(time.Second), float64(len(msgs))/elapsed.Seconds())
	fmt.Fprintf(&b, "faults: %d kill -9 (each restarted), %d broker connection reset, %d PostgreSQL restart\n\n", kills, resets, restarts)
	fmt.Fprintf(&b, "%-22s %6s %6s %8s %5s %10s %5s %9s %9s\n", "task", "ops", "calls", "answered", "lost", "unexp.dup", "held", "retry x2", "outside✗")
	names := make([]string, 0, len(byTask))
	for n := range byTask {
		names = append(names, n)
	}
	sort.Strings(names)
	var sum tally
	for _, n := range names {
		x := byTask[n]
		sum.add(*x)
		fmt.Fprintf(&b, "%-22s %6d %6d %8d %5d %10d %5d %9d %9d\n", n, x.ops, x.calls, x.answered, x.lost, x.duplicates, x.held, x.retried, x.outsideFailed)
	}
	fmt.Fprintf(&b, "%-22s %6d %6d %8d %5d %10d %5d %9d %9d\n", "total", sum.ops, sum.calls, sum.answered, sum.lost, sum.duplicates, sum.held, sum.retried, sum.outsideFailed)
	b.WriteString("\ncalls: task ids; answered: calls with a result; lost: an operation with no effect and no hold; unexp.dup: more effects than its mode allows;\n" +
		"held: email (policy hold) whose worker died mid-send, kept for a person; retry x2: replay.notify\n" +
		"(policy retry) run twice after a kill; outside✗: the simulated outside system (in the restarted\n" +
		"database) failed the call and the caller was told.\n")
	t.Log(b.String())
	if sum.lost != 0 || sum.duplicates != 0 {
		t.Errorf("soak: %d lost and %d unexpected duplicates, want 0 and 0", sum.lost, sum.duplicates)
	}
}

// add registers a call of operation op of task without publishing it.
func (w *workload) add(task, op string) *celeryproto.Message {
	o := w.by[op]
	if o == nil {
		o = &operation{task: task, op: op}
		w.by[op] = o
		w.ops = append(w.ops, o)
	}
	m := w.e.Message(task, testkit.NewID(), args(task, op), nil)
	o.msgs = append(o.msgs, m)
	return m
}

// settled reports whether every call not held has a reply.
func (w *workload) settled() bool {
	for _, o := range w.ops {
		for _, m := range o.msgs {
			if len(w.e.Replies(m.ID)) == 0 && !w.held(o) {
				return false
			}
		}
	}
	return true
}
