package tasks

// Stage 1, decode. Receives a job from the arrival goroutines' queue, its
// delivery charged what decoding it may take (memory.go). Decodes the
// delivery's Celery wire form (delivery.wire, transport.go), whatever its
// transport. Hands on the job with its Celery message (j.msg), charged what the message really costs. A
// delivery that cannot be decoded, or that came more often than
// Config.MaxAttempts, is answered and quarantined here.

import (
	"context"
	"errors"
	"fmt"

	"github.com/onceler/onceler/celeryproto"
)

// decode decodes j's delivery through the memory budget (w.dec) and checks
// its transport's delivery count against Config.MaxAttempts and the
// transport's own delivery limit (a quorum queue's x-delivery-limit). It answers the
// delivery (a FAILURE when its caller can be named, then quarantine) and
// returns false when the delivery goes no further.
func (w *Worker) decode(ctx context.Context, j *job) bool {
	msg, err := w.dec.Decode(j.d.wire())
	if err != nil {
		w.quarantineUndecodable(ctx, j, err)
		return false
	}
	w.mu.Lock() // Reserved reads it
	j.msg = msg
	w.mu.Unlock()
	if n := j.d.deliveryCount(); n > w.cfg.MaxAttempts {
		w.quarantinePoison(ctx, j, fmt.Errorf("delivered %d times (limit %d)", n, w.cfg.MaxAttempts))
		return false
	} else if lim := j.d.deliveryLimit(); lim > 0 && n >= lim {
		// The broker's last delivery: should it fail too, the queue would
		// drop the message (or dead-letter it), and its caller would never
		// hear. Quarantined instead, with its caller answered.
		w.quarantinePoison(ctx, j, fmt.Errorf("delivered %d times: the queue's delivery limit (x-delivery-limit %d) drops it after this delivery", n, lim))
		return false
	}
	return true
}

// memDecoder decodes the worker's deliveries, settling each one's charge
// against the budget.
type memDecoder struct {
	w   *Worker
	dec *celeryproto.Decoder
}

// Decode decodes d, refusing it when its decoding would need more than the
// whole budget, and charges the delivery what its decoded message costs.
func (m *memDecoder) Decode(d *celeryproto.Delivery) (*celeryproto.Message, error) {
	w := m.w
	w.mu.Lock()
	j := w.charged[d]
	var need int64
	if j != nil {
		need = j.need
	}
	w.mu.Unlock()
	if need > w.cfg.MemoryBudget {
		return nil, &celeryproto.DecodeError{Reason: celeryproto.ErrTooLarge,
			Detail: fmt.Sprintf("decoding needs up to %d bytes of memory, more than the memory budget of %d", need, w.cfg.MemoryBudget)}
	}
	w.makeRoom(need)
	msg, cost, err := m.dec.DecodeCost(d)
	if j != nil {
		w.decoded(j, msg, cost)
	}
	return msg, err
}

// quarantineUndecodable answers a delivery whose body cannot be read (or is
// pickle) when its caller can still be named, by the task id header (else
// the correlation id) and reply_to, and quarantines it. The caller gets
// FAILURE ContentDisallowed for pickle, DecodeError otherwise: what kombu
// raises for such a body.
func (w *Worker) quarantineUndecodable(ctx context.Context, j *job, cause error) {
	d := j.d.wire()
	id, _ := d.Headers["id"].(string)
	if id == "" {
		id = d.CorrelationID
	}
	if id != "" && (d.ReplyTo != "" || w.backend != nil) {
		exc := &celeryproto.Exception{Type: "DecodeError", Module: "kombu.exceptions", Message: cause.Error()}
		if errors.Is(cause, celeryproto.ErrPickle) {
			exc.Type = "ContentDisallowed"
		}
		r := &celeryproto.Result{TaskID: id, Status: celeryproto.StateFailure, Exception: exc, Traceback: cause.Error()}
		if !w.publishResultTo(ctx, j, d.ReplyTo, r) {
			return
		}
	}
	w.quarantine(ctx, j, ReasonUndecodable, cause)
}
