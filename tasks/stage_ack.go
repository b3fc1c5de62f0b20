package tasks

// Stage 8, ack. Receives a job whose caller has been answered, or one to
// give back unanswered. Acknowledges its delivery, or gives it back to its
// transport (transport.go; the AMQP transport: a nack with requeue),
// and releases what the worker kept for it: its place among the reserved
// deliveries and its memory charge. The delivery leaves the pipeline here.

import (
	"time"

	"go.uber.org/zap"
)

// ack acknowledges the delivery; a stale delivery (its channel is gone)
// comes back from the broker and is answered from the record then.
func (w *Worker) ack(j *job) {
	w.forget(j)
	if err := j.d.ack(); err != nil {
		w.log.Info("ack failed; the broker redelivers the message", w.fields(j, zap.Error(err))...)
	}
}

// requeue gives the delivery back to the broker unanswered. w.mu is held.
func (w *Worker) requeue(j *job) {
	delete(w.reserved, j)
	w.release(j)
	w.settled.Store(time.Now().UnixNano())
	if err := j.d.giveBack(); err != nil {
		w.log.Debug("requeue failed; the broker redelivers the message when the channel closes", zap.Error(err))
	}
}

// giveBack is requeue for callers that do not hold w.mu.
func (w *Worker) giveBack(j *job) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.requeue(j)
}

// forget removes j from the reserved set: it has been answered.
func (w *Worker) forget(j *job) {
	w.mu.Lock()
	delete(w.reserved, j)
	w.release(j)
	w.mu.Unlock()
	w.settled.Store(time.Now().UnixNano())
}
