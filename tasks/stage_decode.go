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

	"go.uber.org/zap"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/clip"
	"github.com/onceler/onceler/internal/intval"
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
	n := j.d.deliveryCount()
	carried := carriedDeliveries(j.d.wire().Headers)
	lim := j.d.deliveryLimit()
	total := carried + n
	if total > w.cfg.MaxAttempts {
		cause := fmt.Errorf("delivered %d times (limit %d)", total, w.cfg.MaxAttempts)
		if carried > 0 {
			cause = fmt.Errorf("delivered %d times (limit %d), %d of them before it was republished on the last delivery its queue's x-delivery-limit allowed",
				total, w.cfg.MaxAttempts, carried)
		}
		w.quarantinePoison(ctx, j, cause)
		return false
	} else if lim > 0 && n >= lim {
		// The broker's last delivery: should its run fail, the queue would
		// drop the message (or dead-letter it), and its caller would never
		// hear. It did not necessarily fail before (a graceful shutdown or
		// a node failover returns deliveries too): a copy carrying its
		// count goes back to the queue, counted afresh by the broker, and
		// this delivery is acknowledged. The copy runs; MaxAttempts bounds
		// the deliveries of all copies.
		w.passOn(ctx, j, total+1, lim)
		return false
	}
	return true
}

// passOn republishes j's message with its deliveries so far (the broker's
// last delivery: see decode) and acknowledges the delivery once the copy
// is confirmed.
func (w *Worker) passOn(ctx context.Context, j *job, deliveries, limit int) {
	const what = "republish on the last delivery the queue's x-delivery-limit allows"
	if err := j.d.passOn(ctx, deliveries); err != nil {
		if amqp.IsPermanent(err) {
			// The broker refuses the copy for what it is: answered and
			// quarantined (the task is not bound yet: publishRefused
			// would name it).
			cause := fmt.Errorf("%s: %w", what, err)
			w.log.Error("publish refused by the broker; caller answered FAILURE, message quarantined",
				w.fields(j, zap.String("error", clip.String(cause.Error(), maxLogField)))...)
			exc := &celeryproto.Exception{Type: "PublishRefused", Module: "onceler.exceptions",
				Message: clip.String(cause.Error(), maxDetail)}
			if w.replyFailure(ctx, j, exc, cause) {
				w.quarantine(ctx, j, ReasonPublishRefused, cause)
			}
			return
		}
		// Kept and decoded again later (process), as a held delivery
		// whose republish fails is.
		w.recordTrouble(ctx, j, what, err)
		return
	}
	w.log.Info("message republished on the last delivery its queue's x-delivery-limit allows; it runs from the copy",
		w.fields(j, zap.Int("deliveries", deliveries), zap.Int("x_delivery_limit", limit))...)
	w.ack(j)
}

// carriedDeliveries reads HeaderDeliveries: the deliveries of a message
// before it was republished on its queue's last allowed delivery; 0 when
// absent or unreadable.
func carriedDeliveries(h map[string]any) int {
	n, _ := intval.Whole(h[HeaderDeliveries])
	return int(min(max(n, 0), 1<<20))
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
