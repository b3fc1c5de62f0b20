package tasks

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/testkit"
)

// rateLimitedRegistry: t.block (blockRegistry) and t.rl, a task
// rate-limited to rate that returns at once.
func rateLimitedRegistry(t *testing.T, release <-chan struct{}, started chan<- string, rate string) *Registry {
	t.Helper()
	r := blockRegistry(t, release, started)
	if err := Register(r, Task[blockArgs]{Name: "t.rl", RateLimit: rate, Run: func(ctx context.Context, c *Call, _ blockArgs) (any, error) {
		started <- "rl:" + c.TaskID
		return "ok", nil
	}}); err != nil {
		t.Fatal(err)
	}
	return r
}

// heldBytes: what the held ETA deliveries are charged, how many there are,
// the budget's charge in all, and how many deliveries wait for room.
func (e *env) heldBytes(w *Worker) (held int64, n int, used int64, waiting int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for j := range w.held {
		held += j.charge
	}
	return held, len(w.held), w.memUsed, len(w.waiting)
}

// waitHeld waits until k deliveries are held for their ETA.
func (e *env) waitHeld(w *Worker, k int) {
	e.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		if _, nh, _, _ := e.heldBytes(w); nh == k {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	_, nh, _, _ := e.heldBytes(w)
	e.t.Fatalf("%d deliveries held for their ETA, want %d", nh, k)
}

// holdETA publishes n t.block deliveries of pad bytes due at eta and
// waits until they are all held.
func (e *env) holdETA(w *Worker, n, pad int, eta time.Time) {
	e.t.Helper()
	for i := range n {
		e.publishBlock(taskID(i), pad, "", eta)
	}
	e.waitHeld(w, n)
}

// publishZlib publishes a t.block task compressed with zlib (as by a
// Celery producer with task_compression="zlib"): estimated at over half
// a budget of 128 MiB or less before decoding.
func (e *env) publishZlib(id string, pad int, eta time.Time) {
	e.t.Helper()
	p, err := celeryproto.EncodeTask(&celeryproto.Message{Task: "t.block", ID: id,
		Kwargs: map[string]any{"pad": strings.Repeat("a", pad)}, ETA: eta}, celeryproto.EncodeOptions{Compression: "zlib"})
	if err != nil {
		e.t.Fatal(err)
	}
	e.publishRaw(p)
}

// startedWithin reports whether id starts within d (others may start
// meanwhile).
func startedWithin(started <-chan string, id string, d time.Duration) bool {
	timeout := time.After(d)
	for {
		select {
		case got := <-started:
			if got == id {
				return true
			}
		case <-timeout:
			return false
		}
	}
}

// startRateLimited starts a worker of two slots under a 64 MiB budget with
// t.block and t.rl (1/m), and publishes nr t.rl deliveries of about 3 MiB
// each once decoded: the first runs at once, the others wait for their
// start on a timer, without a slot.
func (e *env) startRateLimited(nr int) (*Worker, chan string) {
	e.t.Helper()
	w, started := e.startTwoSlots(64<<20, func(release <-chan struct{}, started chan<- string) *Registry {
		return rateLimitedRegistry(e.t, release, started, "1/m")
	})
	for i := range nr {
		e.publish(&celeryproto.Message{Task: "t.rl", ID: taskID(500 + i), Kwargs: map[string]any{"pad": strings.Repeat("r", 3<<19)}})
	}
	select {
	case <-started:
	case <-time.After(20 * time.Second):
		e.t.Fatal("the first rate-limited task did not start")
	}
	return w, started
}

// TestDueNowNotKeptOutByRateLimitedAndHeld: held ETA deliveries (30 MiB,
// under half of a 64 MiB budget) and a delivery waiting for its task's rate
// limit (1/m, about 3 MiB, no task slot) both wait on a timer; a tiny task
// due now that a Celery producer compressed with zlib (estimated at 32 MiB
// and 70 KiB before decoding) would wait for them: held ones go back to
// make room, and it runs at once.
func TestDueNowNotKeptOutByRateLimitedAndHeld(t *testing.T) {
	e := newEnv(t)
	w, started := e.startRateLimited(2)
	cfg := w.cfg
	// 15 deliveries due in an hour, about 2 MiB each once decoded (body
	// and decoded pad): 30 MiB, under half the budget.
	e.holdETA(w, 15, 1<<20, time.Now().Add(time.Hour))
	held, nh, used, _ := e.heldBytes(w)
	t.Logf("%d held for their ETA (%d KiB), %d KiB charged in all, budget %d KiB", nh, held>>10, used>>10, cfg.MemoryBudget>>10)
	head := taskID(400)
	sent := time.Now()
	e.publishZlib(head, 1, time.Time{})
	if !startedWithin(started, head, 20*time.Second) {
		held, nh, used, waiting := e.heldBytes(w)
		t.Errorf("a tiny zlib task due now has not started after 20 s with both slots free: %d held (%d KiB), %d waiting, %d of %d KiB charged, %v held sent back",
			nh, held>>10, waiting, used>>10, cfg.MemoryBudget>>10, counterValue(w.m.etaRequeued))
		startedWithin(started, head, 2*time.Minute)
	}
	t.Logf("the task due now started %s after it was sent; %v held deliveries sent back", time.Since(sent).Round(100*time.Millisecond), counterValue(w.m.etaRequeued))
	if _, err := e.ch.QueuePurge(e.queue, false); err != nil {
		t.Fatal(err)
	}
}

// TestDueNowNotKeptOutWhenHeldJoins: a delivery due later that is decoded
// while a delivery waits for room is then held (it waits on a timer from
// then on): the waiting one is weighed again, held ones go back for it, and
// it runs. Held ETA deliveries take about 32650 KiB of a 64 MiB budget; a
// zlib-compressed ETA delivery (about 100 KiB once decoded) arrives with a
// tiny zlib task due now right behind it (each estimated at 32 MiB and 70
// KiB before decoding), three rounds.
func TestDueNowNotKeptOutWhenHeldJoins(t *testing.T) {
	for round := range 3 {
		e := newEnv(t)
		w, started := e.startTwoSlots(64<<20, func(release <-chan struct{}, started chan<- string) *Registry {
			return blockRegistry(t, release, started)
		})
		cfg := w.cfg
		later := time.Now().Add(time.Hour)
		const n = 15
		e.holdETA(w, n, 1<<20, later)
		held, _, _, _ := e.heldBytes(w)
		per := held / n
		rest := per - 2<<20
		target := int64(32650 << 10)
		e.publishBlock(taskID(n), int((target-held-rest)/2), "", later)
		e.waitHeld(w, n+1)
		held, _, _, _ = e.heldBytes(w)
		x := taskID(300)
		e.publishZlib(taskID(100), 95<<10, later.Add(time.Hour))
		e.publishZlib(x, 1, time.Time{})
		sent := time.Now()
		if !startedWithin(started, x, 20*time.Second) {
			h2, nh2, used2, waiting := e.heldBytes(w)
			t.Errorf("round %d: the tiny zlib task due now has not started after 20 s with both slots free and nothing running: "+
				"%d held (%d KiB; %d KiB before A), %d waiting, %d of %d KiB charged, %v held sent back",
				round, nh2, h2>>10, held>>10, waiting, used2>>10, cfg.MemoryBudget>>10, counterValue(w.m.etaRequeued))
		}
		if !t.Failed() {
			t.Logf("round %d: the task due now started %s after it was sent; %v held sent back", round, time.Since(sent).Round(time.Millisecond), counterValue(w.m.etaRequeued))
		}
		if _, err := e.ch.QueuePurge(e.queue, false); err != nil {
			t.Fatal(err)
		}
		if t.Failed() {
			return
		}
	}
}

// TestHeldNotSentBackInVain: deliveries waiting for their task's rate
// limit (1/m) hold over half of a 64 MiB budget; five held ETA deliveries
// take about 10 MiB; a tiny zlib task due now (estimated at just over half
// the budget) arrives. The rate-limited ones alone keep it out until their
// timers fire, so sending held ones back cannot let it in: none go.
func TestHeldNotSentBackInVain(t *testing.T) {
	e := newEnv(t)
	const nr = 12
	w, started := e.startRateLimited(nr)
	cfg := w.cfg
	timedOf := func() (int64, int) {
		w.mu.Lock()
		defer w.mu.Unlock()
		return w.timedCharge(), len(w.timers)
	}
	testkit.WaitFor(t, "rate-limited deliveries on a timer", 20*time.Second, func() bool {
		_, n := timedOf()
		return n == nr-1
	})
	e.holdETA(w, 5, 1<<20, time.Now().Add(time.Hour))
	held, nh, used, _ := e.heldBytes(w)
	timed, nt := timedOf()
	t.Logf("%d held (%d KiB); %d on timers (%d KiB); %d KiB charged of %d", nh, held>>10, nt, timed>>10, used>>10, cfg.MemoryBudget>>10)
	head := taskID(400)
	r0 := counterValue(w.m.etaRequeued)
	e.publishZlib(head, 1, time.Time{})
	time.Sleep(5 * time.Second)
	r1 := counterValue(w.m.etaRequeued)
	held, nh, used, waiting := e.heldBytes(w)
	ran := false
	for len(started) > 0 {
		if <-started == head {
			ran = true
		}
	}
	t.Logf("5 s later: head ran %v; %d held (%d KiB), %d waiting, %d KiB charged; %v held sent back", ran, nh, held>>10, waiting, used>>10, r1-r0)
	if !ran && r1-r0 > 0 {
		t.Errorf("%v held deliveries sent back, yet the task due now still waits (for the rate-limited ones)", r1-r0)
	}
	if _, err := e.ch.QueuePurge(e.queue, false); err != nil {
		t.Fatal(err)
	}
}
