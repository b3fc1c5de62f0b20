package tasks

import (
	"bufio"
	"context"
	"os"
	"runtime"
	rtmetrics "runtime/metrics"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/onceler/onceler/celeryproto"
)

// The memory budget (Config.MemoryBudget) bounds the memory of the
// deliveries the worker holds: each is charged, when it arrives, what
// decoding it may take at its peak (celeryproto's Decoder.Estimate: the
// body, the decompressor's window, the decompressed body, the decoded
// values at a cost per element), and once decoded what it really takes (its
// body and its decoded values). A delivery that does not fit waits,
// undecoded, until earlier ones are settled and release their charge; the
// prefetch window is capped meanwhile, so the broker stops sending. A
// delivery that would need more than the whole budget is refused
// (quarantined as undecodable) without being decoded. Deliveries held for
// their ETA may take half of the budget; past that a delivery due later is
// sent back to the end of its queue (republished, then acknowledged)
// instead of being held.

// deliveryOverhead is charged for each delivery besides its body: its
// headers, properties and the job around it.
const deliveryOverhead = 4 << 10

// Bounds of the default memory budget.
const (
	minMemoryBudget     = 64 << 20
	maxDefaultMemBudget = 2 << 30
)

// DefaultMemoryBudget is Config.MemoryBudget's default: a quarter of the
// memory available to the process (the cgroup's memory limit if it has one,
// else the machine's memory), at least 64 MiB, at most 2 GiB.
func DefaultMemoryBudget() int64 {
	return min(max(availableMemory()/4, minMemoryBudget), maxDefaultMemBudget)
}

// availableMemory is the cgroup v2 (or v1) memory limit when set, else the
// machine's memory from /proc/meminfo, else 1 GiB.
func availableMemory() int64 {
	mem := int64(0)
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		sc := bufio.NewScanner(strings.NewReader(string(b)))
		for sc.Scan() {
			f := strings.Fields(sc.Text())
			if len(f) >= 2 && f[0] == "MemTotal:" {
				if kb, err := strconv.ParseInt(f[1], 10, 64); err == nil {
					mem = kb << 10
				}
			}
		}
	}
	for _, p := range []string{"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"} {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		if err == nil && n > 0 && (mem == 0 || n < mem) {
			mem = n
		}
	}
	if mem <= 0 {
		mem = 1 << 30
	}
	return mem
}

// decoderLimits are the per-message limits under a budget: a body at most
// an eighth of it, its decoded values at most a quarter, so that the
// decoding of one message fits the budget alongside others.
func decoderLimits(budget int64) celeryproto.Limits {
	return celeryproto.Limits{
		MaxBodyBytes:    int(min(celeryproto.DefaultMaxBodyBytes, budget/8)),
		MaxDecodedBytes: int(min(celeryproto.DefaultMaxDecodedBytes, budget/4)),
		MaxElements:     celeryproto.DefaultMaxElements,
	}
}

// gcSlack is how far the heap (live objects and garbage not yet collected)
// plus a large decode may go past the budget before the garbage is
// collected first.
const gcSlack = 64 << 20

// heapObjectsMetric is the runtime metric of the heap's objects, live and
// not yet collected.
const heapObjectsMetric = "/memory/classes/heap/objects:bytes"

// makeRoom collects the garbage before a decode that may take need bytes
// (at least a sixteenth of the budget) when the heap's objects, live or
// dead, plus need would pass the budget by more than gcSlack. The budget
// bounds what is live; garbage is the collector's, and with the worker's
// GOGC of 400, or a collector held back by a busy CPU (the Go memory
// limit yields to its CPU cap), a stream of large decodes would otherwise
// pile up garbage far past the budget. Calls are serialized so that one
// collection serves the decodes waiting for it.
func (w *Worker) makeRoom(need int64) {
	if need < w.cfg.MemoryBudget/16 {
		return
	}
	w.gcMu.Lock()
	defer w.gcMu.Unlock()
	sample := []rtmetrics.Sample{{Name: heapObjectsMetric}}
	rtmetrics.Read(sample)
	if sample[0].Value.Kind() != rtmetrics.KindUint64 {
		return
	}
	if int64(sample[0].Value.Uint64())+need <= w.cfg.MemoryBudget+gcSlack {
		return
	}
	runtime.GC()
	w.m.collections.Inc()
}

// admit charges j its estimate and hands it to the task goroutines, or
// queues it until the budget has room. A delivery that would need more than
// the whole budget is charged its body only and handed over at once: it is
// refused before decoding. w.mu is held.
func (w *Worker) admit(j *job) {
	d := j.d.wire()
	if n := int64(len(d.Body)); n > w.largest {
		w.largest = n
	}
	j.need = w.dec.dec.Estimate(d) + deliveryOverhead
	if j.need > w.cfg.MemoryBudget {
		w.charge(j, int64(len(d.Body))+deliveryOverhead)
		w.admitted(j)
		return
	}
	if len(w.waiting) == 0 && w.fits(j.need) {
		w.charge(j, j.need)
		w.admitted(j)
		return
	}
	w.waiting = append(w.waiting, j)
	w.m.memWaiting.Set(float64(len(w.waiting)))
	w.admitWaiting()
	w.flowChanged()
}

// evictHeld sends deliveries held for their ETA back to their queue when
// the deliveries waiting on a timer (held for their ETA, for their task's
// rate limit, deferred: timedCharge) would keep a delivery that needs need
// bytes out of the budget even once everything else charged is settled:
// those due latest go, until the rest and need fit (none when the others
// on a timer keep it out by themselves). Short of that, the waiting
// delivery waits for the running and decoding ones to release their
// charges, as it would with none held: sending held ones back for it
// would bring each back as a fresh delivery, charged its estimate before
// decoding (often many times what it held), to wait in its turn and send
// back others, for as long as the running tasks hold the rest. Each goes to
// the task goroutines marked to be republished (j.rehold), which
// acknowledges it and releases its charge. w.mu is held.
func (w *Worker) evictHeld(need int64) {
	timed := w.timedCharge()
	if timed+need <= w.cfg.MemoryBudget {
		return
	}
	held := make([]*job, 0, len(w.held))
	heldCharge := int64(0)
	for h := range w.held {
		if _, ok := w.timers[h]; ok && h.msg != nil {
			held = append(held, h)
			heldCharge += h.charge
		}
	}
	if timed-heldCharge+need > w.cfg.MemoryBudget {
		return // the others on a timer keep it out: sending held ones back would not let it in
	}
	slices.SortFunc(held, func(a, b *job) int { return b.msg.ETA.Compare(a.msg.ETA) })
	for _, h := range held {
		if timed+need <= w.cfg.MemoryBudget {
			break
		}
		tm, ok := w.timers[h]
		if !ok {
			continue // gone meanwhile (a requeue's release weighed the waiting again)
		}
		tm.Stop()
		delete(w.timers, h)
		delete(w.held, h)
		w.scheduled--
		w.m.scheduled.Dec()
		w.m.etaRequeued.Inc()
		h.rehold, h.evicted = true, true
		timed -= h.charge
		w.enqueue(h)
	}
}

// timedCharge is what the deliveries waiting on a timer are charged: they
// keep it while they wait, however long the tasks run. w.mu is held.
func (w *Worker) timedCharge() int64 {
	n := int64(0)
	for j := range w.timers {
		n += j.charge
	}
	return n
}

// fits reports whether n more bytes fit the budget; anything fits when
// nothing is charged. w.mu is held.
func (w *Worker) fits(n int64) bool {
	return w.memUsed == 0 || w.memUsed+n <= w.cfg.MemoryBudget
}

// charge sets j's charge to n. w.mu is held.
func (w *Worker) charge(j *job, n int64) {
	w.memUsed += n - j.charge
	j.charge = n
	w.charged[j.d.wire()] = j
	w.m.memCharged.Set(float64(w.memUsed))
	w.flowChanged()
}

// release gives back j's charge (j is settled or given back) and admits the
// deliveries waiting for it. w.mu is held.
func (w *Worker) release(j *job) {
	if i := indexOf(w.waiting, j); i >= 0 {
		w.waiting = append(w.waiting[:i], w.waiting[i+1:]...)
		w.m.memWaiting.Set(float64(len(w.waiting)))
	}
	if _, ok := w.charged[j.d.wire()]; !ok {
		return
	}
	delete(w.charged, j.d.wire())
	w.memUsed -= j.charge
	j.charge = 0
	w.m.memCharged.Set(float64(w.memUsed))
	w.admitWaiting()
	w.flowChanged()
}

func indexOf(js []*job, j *job) int {
	for i, x := range js {
		if x == j {
			return i
		}
	}
	return -1
}

// admitWaiting hands over the waiting deliveries that now fit, in order of
// arrival. When the first does not fit and the deliveries waiting on a
// timer would keep it out even once the others are settled, held ones due
// latest go back to the end of their queue (republished, then
// acknowledged) to make room (evictHeld). w.mu is held.
func (w *Worker) admitWaiting() {
	for len(w.waiting) > 0 {
		j := w.waiting[0]
		if !j.d.stale() && !w.fits(j.need) {
			w.evictHeld(j.need)
			break
		}
		w.waiting = w.waiting[1:]
		w.m.memWaiting.Set(float64(len(w.waiting)))
		if j.d.stale() {
			delete(w.reserved, j) // the broker redelivers it
			continue
		}
		if w.stopping {
			w.requeue(j)
			continue
		}
		w.charge(j, j.need)
		w.admitted(j)
	}
}

// decoded lowers j's charge to what its decoded message costs (body and
// values) and decides whether a delivery due later may be held for its
// ETA: held deliveries may take half the budget; past it the delivery goes
// back to the end of its queue instead (j.rehold, before it is held).
func (w *Worker) decoded(j *job, msg *celeryproto.Message, cost int64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if _, ok := w.charged[j.d.wire()]; !ok {
		return
	}
	if actual := int64(len(j.d.wire().Body)) + deliveryOverhead + cost; actual < j.charge {
		w.charge(j, actual)
		w.admitWaiting()
	}
	if msg == nil || msg.ETA.IsZero() || !time.Now().Before(msg.ETA) {
		return
	}
	var held int64
	for h := range w.held {
		held += h.charge
	}
	if held+j.charge > w.cfg.MemoryBudget/2 {
		j.rehold = true
		w.m.etaRequeued.Inc()
		if ce := w.log.Check(zap.DebugLevel, "deliveries held for their ETA fill half the memory budget: this one goes back to the end of its queue"); ce != nil {
			ce.Write(zap.String("task_id", msg.ID), zap.Int64("held_bytes", held), zap.Time("eta", msg.ETA))
		}
	}
}

// sweepCharges releases the charges of deliveries whose channel is gone and
// that the worker no longer holds (held ETA deliveries dropped with their
// channel), and lets the largest body seen decay. Called every second;
// w.mu is held.
func (w *Worker) sweepCharges() {
	w.largest -= w.largest / 8
	for _, j := range w.charged {
		if _, ok := w.reserved[j]; ok || w.active[j] != nil || !j.d.stale() {
			continue
		}
		w.release(j)
	}
}

// flowChanged asks the flow goroutine to recompute the window limit. w.mu
// is held.
func (w *Worker) flowChanged() {
	select {
	case w.flowKick <- struct{}{}:
	default:
	}
}

// windowLimit is the prefetch cap under the budget: none while the budget
// has room for a full window of the largest bodies (the largest accepted,
// or a larger one seen lately: a body arrives whole before the worker can
// refuse it); else the deliveries held plus as many of the largest bodies
// as the free budget holds (at least one in all: 0 would lift the limit);
// while deliveries wait for memory, the deliveries held: none more until
// some are settled.
func (w *Worker) windowLimit() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	held := len(w.reserved) + len(w.active)
	largest := max(int64(w.dec.dec.Limits().MaxBodyBytes), w.largest) + deliveryOverhead
	free := w.cfg.MemoryBudget - w.memUsed
	switch {
	case len(w.waiting) > 0:
		return max(1, held)
	case free >= int64(w.cfg.Prefetch+w.scheduled)*largest:
		return 0
	default:
		return min(65535, max(1, held+int(max(free, 0)/largest)))
	}
}

// flow applies windowLimit to the transport when it changes, at most every
// 50 ms, until ctx is done. Where the window is fixed (transport.fixedWindow)
// it applies none: a quorum queue counts its window per consumer, and a
// change of it restarts the consumers, whose new window comes on top of the
// deliveries still held: a cap would let more in, not fewer. The window stays Config.Prefetch; the
// deliveries past the budget wait undecoded.
func (w *Worker) flow(ctx context.Context) {
	applied := 0
	for {
		select {
		case <-ctx.Done():
			return
		case <-w.flowKick:
		}
		n := 0
		if !w.tr.fixedWindow() {
			n = w.windowLimit()
		}
		if n != applied {
			if err := w.tr.setWindowLimit(n); err != nil {
				w.log.Warn("limit the prefetch window for the memory budget", zap.Int("limit", n), zap.Error(err))
			} else {
				applied = n
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(50 * time.Millisecond):
		}
	}
}
