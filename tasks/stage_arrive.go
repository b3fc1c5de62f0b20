package tasks

// Stage 0, arrival. Receives a delivery admitted under the memory budget
// (memory.go), before any task slot is free: the arrival goroutines take it
// through the decode and bind stages (which send task-received, as Celery's
// consumer does when it takes a message from the broker) and the due stage
// (a revoked or expired message is answered, one due later held for its
// ETA), then hand it to the task goroutines, where it waits for a slot. A
// delivery waiting for a slot is thus listed by inspect reserved with its
// full request, and one held for its ETA by inspect scheduled.

import (
	"context"
	"runtime"
)

// arrivers is how many arrival goroutines the worker runs: one per task
// slot at start, at most GOMAXPROCS and 4 (decoding is quick; one goroutine
// keeps the order of arrival when there is one slot).
func (w *Worker) arrivers() int {
	return max(1, min(w.cfg.Concurrency, runtime.GOMAXPROCS(0), 4))
}

// arriveLoop is one arrival goroutine.
func (w *Worker) arriveLoop(ctx context.Context) {
	for {
		select {
		case <-w.quit:
			return
		case j := <-w.arrivals:
			w.arrive(ctx, j)
		}
	}
}

// arrive takes a fresh delivery through decode, bind and due, and hands it
// to the task goroutines when it is to run now. Every other outcome answers,
// holds or gives back the delivery in the stage that decided it.
func (w *Worker) arrive(ctx context.Context, j *job) {
	if j.d.stale() {
		w.forget(j)
		return
	}
	if !w.decode(ctx, j) || !w.bind(ctx, j) {
		return
	}
	j.prepared = true
	if !w.due(ctx, j) {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.stopping || w.draining.Load() {
		w.requeue(j)
		return
	}
	w.enqueue(j)
}

// admitted hands a delivery just charged against the budget on: a fresh one
// to the arrival goroutines, one already through them (or with a verdict)
// to the task goroutines. w.mu is held.
func (w *Worker) admitted(j *job) {
	if j.prepared || j.verdict != nil || w.arrivals == nil {
		w.enqueue(j)
		return
	}
	select {
	case w.arrivals <- j:
	default:
		w.log.Error("arrival buffer full: requeueing delivery")
		w.requeue(j)
	}
}
