package amqp

import (
	"slices"
	"sync"
	"time"
)

// acker coalesces the acknowledgements of one channel. Delivery tags are
// consecutive on a channel, so when the deliveries settled so far form a run
// from the lowest unsettled tag, one basic.ack with multiple=true answers
// the whole run: one frame (and one write) instead of one per delivery.
//
// Only tags settled explicitly (Ack, Nack, Reject) are ever covered: a
// multiple ack goes up to the highest waiting ack of the unbroken run of
// settled tags that starts at base, the lowest tag not known settled. A
// delivery still running, or one the broker sent that was never handed out,
// ends the run, so nothing is acknowledged on its behalf. An ack above such
// a gap waits for the gap to close, at most ackLinger and while no more than
// half the prefetch window waits; then it goes out on its own
// (multiple=false), so a slow task holds back neither the acknowledgements
// of the tasks after it nor much of the prefetch window they free. Under
// load the tasks in flight finish nearly in order and most acks ride on a
// multiple ack: the broker then handles a few frames where it handled one
// per message (in the benchmark, about a quarter less broker CPU per task).
//
// The caller that finds no send in progress sends: its own ack and whatever
// other acks queued meanwhile, until none is left (a group commit). A nack
// or reject is sent by its caller and only then recorded as settled, so a
// multiple ack that later covers its tag follows it on the channel and
// leaves it alone (the broker acks only tags still unacked).
//
// Its zero value is ready to use.
type acker struct {
	mu      sync.Mutex
	base    uint64     // lowest delivery tag not known settled (0 until the first: tags start at 1)
	settled []tagRange // settled tags above base, sorted, disjoint, not adjacent
	queue   []uint64   // acks asked for, not yet looked at by a sender
	held    []uint64   // acks above a gap, not sent yet
	sending bool       // a caller is sending
	eager   bool       // hold nothing: the channel is closing, or a caller needs each ack sent before Ack returns
	maxHeld int        // most acks held above a gap; 0: defaultMaxHeld
	timer   *time.Timer
	send    func(tag uint64, multiple bool) error // of the last ack, for the timer
	sends   ackCounters
}

const (
	// ackLinger is how long an ack above a gap waits for the gap to close:
	// a few of the record's flushes under load.
	ackLinger = 20 * time.Millisecond
	// defaultMaxHeld is how many acks may wait above a gap when the
	// prefetch window is not known.
	defaultMaxHeld = 16
	// flushWait bounds how long flush waits for a sender at work.
	flushWait = 5 * time.Second
)

// setWindow sizes the acks that may wait to half of a prefetch window of n
// (0: unlimited prefetch).
func (a *acker) setWindow(n int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.maxHeld = max(1, n/2)
	if n <= 0 {
		a.maxHeld = 1024
	}
}

type tagRange struct{ lo, hi uint64 }

type ackCounters struct {
	acks, frames int64
}

// ack queues tag's acknowledgement and, when no other caller is sending,
// sends what is due with send(tag, multiple). It returns the error of the
// first failed send this caller made (nil when another caller sends).
func (a *acker) ack(tag uint64, send func(tag uint64, multiple bool) error) error {
	a.mu.Lock()
	if a.base == 0 {
		a.base = 1
	}
	a.queue = append(a.queue, tag)
	a.send = send
	a.sends.acks++
	if a.sending {
		a.mu.Unlock()
		return nil
	}
	return a.run(send, false)
}

// run sends until nothing is due, with a.mu held and a.sending false; it
// returns with a.mu released. expire sends every held ack (the linger is
// over).
func (a *acker) run(send func(tag uint64, multiple bool) error, expire bool) error {
	a.sending = true
	var firstErr error
	for {
		for _, t := range a.queue {
			a.mark(t)
		}
		a.held = append(a.held, a.queue...)
		a.queue = a.queue[:0]
		a.advance()
		// The run from the old base is settled now: one multiple ack for
		// the highest waiting ack in it.
		var hi uint64
		rest := a.held[:0]
		for _, t := range a.held {
			if t < a.base {
				hi = max(hi, t)
			} else {
				rest = append(rest, t)
			}
		}
		a.held = rest
		var singles []uint64
		limit := a.maxHeld
		if limit == 0 {
			limit = defaultMaxHeld
		}
		if expire || a.eager || len(a.held) > limit {
			singles = slices.Clone(a.held)
			a.held = a.held[:0]
			expire = false
		}
		if hi == 0 && len(singles) == 0 {
			break
		}
		if hi > 0 {
			a.sends.frames++
		}
		a.sends.frames += int64(len(singles))
		a.mu.Unlock()
		if hi > 0 {
			if err := send(hi, true); err != nil && firstErr == nil {
				firstErr = err
			}
		}
		for _, t := range singles {
			if err := send(t, false); err != nil && firstErr == nil {
				firstErr = err
			}
		}
		a.mu.Lock()
	}
	if len(a.held) > 0 && a.timer == nil {
		a.timer = time.AfterFunc(ackLinger, a.expire)
	}
	a.sending = false
	a.mu.Unlock()
	return firstErr
}

// expire sends the held acks on their own once they have waited ackLinger.
func (a *acker) expire() {
	a.mu.Lock()
	a.timer = nil
	if a.sending || len(a.held) == 0 {
		// A sender is at work: it arms the timer again if acks are still
		// held when it stops.
		a.mu.Unlock()
		return
	}
	_ = a.run(a.send, true) // a failure means the channel is gone: the broker redelivers
}

// flush sends the held acks now and holds none from now on: the channel is
// about to close, and a held ack would be lost with it. It waits for a
// sender at work at most flushWait (a write stuck on a dead connection ends
// when amqp091's heartbeat gives up on it; the acks are then lost and the
// broker redelivers their messages).
func (a *acker) flush() {
	deadline := time.Now().Add(flushWait)
	for {
		a.mu.Lock()
		a.eager = true
		if a.sending {
			// The sender sends the held acks at its next round.
			a.mu.Unlock()
			if time.Now().After(deadline) {
				return
			}
			time.Sleep(100 * time.Microsecond)
			continue
		}
		if len(a.held) == 0 {
			a.mu.Unlock()
			return
		}
		_ = a.run(a.send, true) // a failure means the channel is gone: the broker redelivers
		return
	}
}

// advance moves base past the run of settled tags that starts there.
func (a *acker) advance() {
	if len(a.settled) > 0 && a.settled[0].lo == a.base {
		a.base = a.settled[0].hi + 1
		a.settled = a.settled[1:]
	}
}

// settledElsewhere records tag as settled by a frame already sent (a nack or
// reject).
func (a *acker) settledElsewhere(tag uint64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.base == 0 {
		a.base = 1
	}
	a.mark(tag)
	a.advance()
}

// mark adds tag to the settled ranges, merging neighbours. Tags below base
// are settled already.
func (a *acker) mark(tag uint64) {
	if tag < a.base {
		return
	}
	i, found := slices.BinarySearchFunc(a.settled, tag, func(r tagRange, t uint64) int {
		switch {
		case r.hi < t:
			return -1
		case r.lo > t:
			return 1
		}
		return 0
	})
	if found {
		return
	}
	// a.settled[i-1].hi < tag < a.settled[i].lo
	joinPrev := i > 0 && a.settled[i-1].hi+1 == tag
	joinNext := i < len(a.settled) && a.settled[i].lo == tag+1
	switch {
	case joinPrev && joinNext:
		a.settled[i-1].hi = a.settled[i].hi
		a.settled = slices.Delete(a.settled, i, i+1)
	case joinPrev:
		a.settled[i-1].hi = tag
	case joinNext:
		a.settled[i].lo = tag
	default:
		a.settled = slices.Insert(a.settled, i, tagRange{tag, tag})
	}
}

// counters returns the acknowledgements asked for and the frames sent.
func (a *acker) counters() ackCounters {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.sends
}
