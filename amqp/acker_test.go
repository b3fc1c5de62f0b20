package amqp

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"
)

// brokerModel plays the broker's side of acknowledgements: frames apply in
// the order they were written, a multiple ack removes every unacked tag up
// to its own (which must be unacked, as RabbitMQ requires), a single frame
// removes its tag (which must be unacked).
type brokerModel struct {
	mu       sync.Mutex
	unacked  map[uint64]bool
	settled  map[uint64]bool // settled by the client before the frame was written
	frames   int
	failures []string
}

func (b *brokerModel) frame(tag uint64, multiple bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.frames++
	if !b.unacked[tag] {
		b.failures = append(b.failures, fmt.Sprintf("frame for tag %d (multiple=%t): unknown delivery tag", tag, multiple))
		return
	}
	if !multiple {
		delete(b.unacked, tag)
		return
	}
	for t := range b.unacked {
		if t <= tag {
			if !b.settled[t] {
				b.failures = append(b.failures, fmt.Sprintf("multiple ack %d covered tag %d, which was never settled", tag, t))
			}
			delete(b.unacked, t)
		}
	}
}

func (b *brokerModel) settle(tag uint64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.settled[tag] = true
}

// TestAckerModel settles deliveries in random orders from several
// goroutines, some by ack, some by nack, some never (a task still running,
// a delivery never handed out), and checks the frames the acker writes
// against the broker model: exactly the settled deliveries are gone, no
// frame names an unknown tag, no multiple ack covers an unsettled one, and
// runs are coalesced.
func TestAckerModel(t *testing.T) {
	t.Parallel()
	for seed := range uint64(100) {
		rng := rand.New(rand.NewPCG(seed, 1))
		n := 1 + rng.IntN(300)
		b := &brokerModel{unacked: map[uint64]bool{}, settled: map[uint64]bool{}}
		var tags []uint64
		open := map[uint64]bool{}
		for tag := uint64(1); tag <= uint64(n); tag++ {
			b.unacked[tag] = true
			if rng.IntN(20) == 0 {
				open[tag] = true // never settled
				continue
			}
			tags = append(tags, tag)
		}
		// Roughly in order, as tasks finish: shuffle within small windows.
		for i := range tags {
			j := min(len(tags)-1, i+rng.IntN(8))
			tags[i], tags[j] = tags[j], tags[i]
		}
		var a acker
		send := func(tag uint64, multiple bool) error {
			b.frame(tag, multiple)
			return nil
		}
		workers := 1 + rng.IntN(8)
		var wg sync.WaitGroup
		next := make(chan uint64)
		for range workers {
			wg.Go(func() {
				for tag := range next {
					b.settle(tag)
					if tag%7 == 0 {
						b.frame(tag, false) // a nack: written, then recorded
						a.settledElsewhere(tag)
						continue
					}
					if err := a.ack(tag, send); err != nil {
						t.Error(err)
					}
				}
			})
		}
		for _, tag := range tags {
			next <- tag
		}
		close(next)
		wg.Wait()
		a.settle(t)
		if len(b.failures) > 0 {
			t.Fatalf("seed %d: %v", seed, b.failures)
		}
		for tag := range b.unacked {
			if !open[tag] {
				t.Fatalf("seed %d: settled tag %d still unacked at the broker", seed, tag)
			}
		}
		if len(b.unacked) != len(open) {
			t.Fatalf("seed %d: %d unacked, want the %d never settled", seed, len(b.unacked), len(open))
		}
	}
}

// TestAckerCoalescesInOrderRuns: deliveries settled nearly in order (each
// run of 8 tags in a shuffled order, as tasks in flight finish), many of
// them while a write is in progress, go out as far fewer frames than acks:
// those queued during a write go out together, and those above a gap wait
// for it to close. The arrivals during a write are played by the write
// itself (the send function settles and acks the next tags), so the
// schedule is the same on a loaded machine as on an idle one: a pool of
// goroutines racing each other made the frame count depend on how the
// machine scheduled them (one descheduled while holding a low tag, and
// every ack above it waited). The concurrent paths are TestAckerModel's.
func TestAckerCoalescesInOrderRuns(t *testing.T) {
	t.Parallel()
	const n, width, perWrite = 2000, 8, 12
	var a acker
	b := &brokerModel{unacked: map[uint64]bool{}, settled: map[uint64]bool{}}
	rng := rand.New(rand.NewPCG(3, 5))
	var order []uint64
	for lo := uint64(1); lo <= n; lo += width {
		run := make([]uint64, 0, width)
		for tag := lo; tag < lo+width && tag <= n; tag++ {
			b.unacked[tag] = true
			run = append(run, tag)
		}
		rng.Shuffle(len(run), func(i, j int) { run[i], run[j] = run[j], run[i] })
		order = append(order, run...)
	}
	// feed settles and acks the next k tags of order. The linger's timer
	// may send too (and so feed), when a slow machine stalls this test for
	// 20 ms with an ack held: mu keeps the two in turn.
	var mu sync.Mutex
	next := 0
	var send func(tag uint64, multiple bool) error
	feed := func(k int) {
		for ; k > 0; k-- {
			mu.Lock()
			if next == len(order) {
				mu.Unlock()
				return
			}
			tag := order[next]
			next++
			mu.Unlock()
			b.settle(tag)
			if err := a.ack(tag, send); err != nil {
				t.Error(err)
			}
		}
	}
	send = func(tag uint64, multiple bool) error {
		b.frame(tag, multiple)
		if multiple {
			// Acks asked for while the write is on its way. Only the
			// multiple acks bring them, so that acks sent one by one
			// (held acks let go) show as frames of their own.
			feed(perWrite)
		}
		return nil
	}
	for {
		mu.Lock()
		done := next == len(order)
		mu.Unlock()
		if done {
			break
		}
		feed(1)
	}
	a.settle(t)
	if len(b.failures) > 0 || len(b.unacked) != 0 {
		t.Fatalf("failures %v, %d unacked", b.failures, len(b.unacked))
	}
	c := a.counters()
	// About one multiple ack per write (n/perWrite); letting the acks
	// above a gap go one by one instead of holding them made 434 frames.
	if want := int64(n / perWrite * 3 / 2); c.acks != n || c.frames > want {
		t.Fatalf("%d acks in %d frames, want at most %d", c.acks, c.frames, want)
	}
	t.Logf("%d acks in %d frames", c.acks, c.frames)
}

// settle waits until no ack is held back (the linger sends them).
func (a *acker) settle(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(time.Second)
	for {
		a.mu.Lock()
		idle := !a.sending && len(a.held) == 0 && len(a.queue) == 0
		a.mu.Unlock()
		if idle {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("acks still held after a second")
		}
		time.Sleep(time.Millisecond)
	}
}
