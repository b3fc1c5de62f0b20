package tasks

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/onceler/onceler/control"
	"github.com/onceler/onceler/internal/testkit"
)

// TestRateLimitOption: a task registered with RateLimit "4/s" starts one
// delivery every 250 ms, while deliveries of another task sent after them
// run at once; SetRateLimit changes it at run time and refuses an unknown
// task.
func TestRateLimitOption(t *testing.T) {
	e := newEnv(t)
	var mu sync.Mutex
	starts := map[string][]time.Time{}
	run := func(_ context.Context, c *Call, _ chargeArgs) (any, error) {
		mu.Lock()
		defer mu.Unlock()
		starts[c.Message.Task] = append(starts[c.Message.Task], time.Now())
		return "ok", nil
	}
	reg := NewRegistry()
	if err := Register(reg, Task[chargeArgs]{Name: "t.limited", Run: run, RateLimit: "4/s"}); err != nil {
		t.Fatal(err)
	}
	if err := Register(reg, Task[chargeArgs]{Name: "t.free", Run: run}); err != nil {
		t.Fatal(err)
	}
	cfg := e.config()
	cfg.Concurrency, cfg.Prefetch = 4, 32
	w := e.start(reg, cfg).w
	const n = 6
	sent := time.Now()
	for i := range n {
		e.publish(payMessage("t.limited", i, "l", ""))
	}
	for i := range n {
		e.publish(payMessage("t.free", n+i, "f", ""))
	}
	count := func(task string) int {
		mu.Lock()
		defer mu.Unlock()
		return len(starts[task])
	}
	testkit.WaitFor(t, "all tasks", 20*time.Second, func() bool { return count("t.limited") == n && count("t.free") == n })
	mu.Lock()
	limited, free := starts["t.limited"], starts["t.free"]
	mu.Unlock()
	if span := limited[n-1].Sub(limited[0]); span < time.Duration(n-1)*250*time.Millisecond-50*time.Millisecond {
		t.Errorf("t.limited (4/s): %d starts within %v", n, span)
	}
	if last := free[n-1].Sub(sent); last > limited[n-1].Sub(sent)-500*time.Millisecond {
		t.Errorf("t.free waited behind t.limited: its last start %v after sending, t.limited's %v", last, limited[n-1].Sub(sent))
	}

	if err := w.SetRateLimit("t.nope", "1/s"); !errors.Is(err, control.ErrUnknownTask) {
		t.Errorf("SetRateLimit of an unknown task = %v", err)
	}
	if err := w.SetRateLimit("t.limited", "2/x"); err == nil {
		t.Error("SetRateLimit accepted 2/x")
	}
	if err := w.SetRateLimit("t.limited", ""); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	starts["t.limited"] = nil
	mu.Unlock()
	sent = time.Now()
	for i := range n {
		e.publish(payMessage("t.limited", 2*n+i, "l2", ""))
	}
	testkit.WaitFor(t, "unlimited tasks", 20*time.Second, func() bool { return count("t.limited") == n })
	mu.Lock()
	defer mu.Unlock()
	if span := starts["t.limited"][n-1].Sub(sent); span > time.Second {
		t.Errorf("with the rate limit lifted, %d starts took %v", n, span)
	}
}

func TestRegisterRefusesBadRateLimit(t *testing.T) {
	for _, r := range []string{"fast", "1/d", "-1/s"} {
		err := Register(NewRegistry(), Task[chargeArgs]{Name: "a", Run: noRun, RateLimit: r})
		if !errors.Is(err, ErrInvalidTask) {
			t.Errorf("RateLimit %q: Register = %v", r, err)
		}
	}
	for _, r := range []string{"", "0", "10", "10/s", "10/m", "1.5/h"} {
		if err := Register(NewRegistry(), Task[chargeArgs]{Name: "a", Run: noRun, RateLimit: r}); err != nil {
			t.Errorf("RateLimit %q: %v", r, err)
		}
	}
}

func TestSlotGate(t *testing.T) {
	var g slotGate
	spawned := 0
	g.start(2, func() { spawned++ })
	quit := make(chan struct{})
	for range 2 {
		if !g.acquire(quit) {
			t.Fatal("two slots not taken")
		}
	}
	got := make(chan bool)
	go func() { got <- g.acquire(quit) }()
	select {
	case <-got:
		t.Fatal("a third slot was taken with a limit of 2")
	case <-time.After(50 * time.Millisecond):
	}
	if n := g.resize(3); n != 3 || spawned != 3 {
		t.Fatalf("resize(3) = %d, %d goroutines", n, spawned)
	}
	if !<-got {
		t.Fatal("grown slot not taken")
	}
	shrunk := g.shrunk()
	g.resize(1)
	select {
	case <-shrunk:
	default:
		t.Fatal("shrinking did not signal")
	}
	g.release()
	g.release()
	go func() { got <- g.acquire(quit) }()
	select {
	case <-got:
		t.Fatal("a slot taken over the limit of 1")
	case <-time.After(50 * time.Millisecond):
	}
	close(quit)
	if <-got {
		t.Fatal("acquire after quit")
	}
	g.stop()
	g.resize(5)
	if spawned != 3 {
		t.Errorf("goroutines started after stop: %d", spawned)
	}
}
