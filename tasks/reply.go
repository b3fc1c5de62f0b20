package tasks

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/clip"
	"github.com/onceler/onceler/internal/pause"
)

// Quarantine headers set on every quarantined message, beside the original
// headers.
const (
	// HeaderReason is the short reason: undecodable, unknown_task,
	// bad_arguments, fingerprint_mismatch or poison.
	HeaderReason = "x-onceler-reason"
	// HeaderDetail is the error text (never argument values).
	HeaderDetail = "x-onceler-detail"
	// HeaderQueue is the queue the message was consumed from.
	HeaderQueue = "x-onceler-queue"
	// HeaderDecodeReason is celeryproto.Reason of an undecodable message,
	// e.g. "pickle" or "malformed".
	HeaderDecodeReason = "x-onceler-decode-reason"
	// HeaderTime is when it was quarantined (RFC 3339, UTC).
	HeaderTime = "x-onceler-quarantined-at"
)

// maxShortString is the longest AMQP short string (correlation_id,
// reply_to, names), in bytes.
const maxShortString = 255

// opTimeout bounds one publish or one final record write.
const opTimeout = 30 * time.Second

// publish publishes with a confirm, bounded by opTimeout. A publish cut
// short by the end of the grace period leaves the delivery unacknowledged:
// its redelivery is answered from the record.
func (w *Worker) publish(ctx context.Context, exchange, key string, p *celeryproto.Publishing, o amqp.PublishOptions) error {
	ctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	return w.pub.Publish(ctx, exchange, key, p, o)
}

// final returns the context of a final record write: not cancelled with
// the task, bounded by opTimeout.
func final(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), opTimeout)
}

// publishResult sends a result to the caller's reply queue with a confirm
// (rpc://) or stores it in the result backend (storeResult), retrying
// while the worker runs. It reports whether the delivery may now be
// acknowledged (false: leave it unacknowledged).
func (w *Worker) publishResult(ctx context.Context, j *job, r *celeryproto.Result) bool {
	return w.publishResultTo(ctx, j, j.msg.ReplyTo, r)
}

// publishResultTo is publishResult to the reply queue replyTo (a chain
// step's, when a failure is carried along the chain).
func (w *Worker) publishResultTo(ctx context.Context, j *job, replyTo string, r *celeryproto.Result) bool {
	if w.backend != nil {
		// A result backend keeps results by task id, whatever reply_to; a
		// chord header part then joins its chord (Celery's mark_as_done and
		// mark_as_failure call on_chord_part_return after the store).
		return w.storeResult(ctx, j, r) && w.chordPartReturn(ctx, j, r)
	}
	if replyTo == "" {
		return true
	}
	r.Serializer = w.cfg.ResultSerializer
	pub, err := celeryproto.EncodeResult(r)
	if err != nil {
		// Cannot happen for values that came from JSON; answer with a failure
		// the caller can read rather than nothing.
		w.log.Error("encode result", w.fields(j, zap.Error(err))...)
		r = &celeryproto.Result{TaskID: r.TaskID, Status: celeryproto.StateFailure, Serializer: r.Serializer,
			Exception: &celeryproto.Exception{Type: "EncodeError", Module: "kombu.exceptions", Message: err.Error()}}
		if pub, err = celeryproto.EncodeResult(r); err != nil {
			return true
		}
	}
	if len(pub.CorrelationID) > maxShortString {
		// A task id an AMQP short string cannot carry: the result goes
		// without a correlation id (Celery's result consumer reads the task
		// id from the body).
		pub.CorrelationID = ""
	}
	for attempt := 0; ; attempt++ {
		err := w.publish(ctx, "", replyTo, pub, amqp.PublishOptions{})
		if err == nil {
			return true
		}
		// A result the broker keeps refusing with a negative confirm (its
		// reply queue full with reject-publish, say) is lost as Celery's
		// worker loses it: sent, and the delivery goes on, rather than run
		// again and again.
		nackedOut := errors.Is(err, amqp.ErrNacked) && attempt >= 5
		if amqp.IsPermanent(err) || nackedOut {
			// The reply address (or the result) is refused for what it is:
			// the caller cannot be answered. Said once; the delivery goes on.
			w.log.Error("result refused by the broker; the caller cannot be answered", w.fields(j,
				zap.String("reply_to", clip.String(replyTo, maxLogField)), zap.String("result_task_id", clip.String(r.TaskID, maxLogField)),
				zap.String("status", string(r.Status)), zap.String("error", clip.String(err.Error(), maxLogField)))...)
			return true
		}
		if ctx.Err() != nil || attempt >= 20 || !pause.For(ctx, min(50*time.Millisecond<<min(attempt, 5), time.Second)) {
			w.log.Warn("result not published; delivery requeued unanswered", w.fields(j, zap.String("error", clip.String(err.Error(), maxLogField)))...)
			w.giveBack(j)
			return false
		}
	}
}

func (w *Worker) replySuccess(ctx context.Context, j *job, res []byte) bool {
	if j.msg.IgnoreResult && j.msg.Chord == nil {
		return true
	}
	v, err := jsonValue(res)
	if err != nil {
		w.log.Error("stored result is not JSON", w.fields(j, zap.Error(err))...)
	}
	r := &celeryproto.Result{TaskID: j.msg.ID, Status: celeryproto.StateSuccess, Value: v}
	if j.msg.IgnoreResult {
		// Not stored, but a chord part still joins its chord, as in Celery.
		return w.chordPartReturn(ctx, j, r)
	}
	return w.publishResult(ctx, j, r)
}

// replyFailure tells the caller FAILURE. The ignore_result option of a call
// does not keep it back: as in Celery's worker (Backend.mark_as_done checks
// it, mark_as_failure and mark_as_retry do not), it drops only SUCCESS.
func (w *Worker) replyFailure(ctx context.Context, j *job, exc *celeryproto.Exception, err error) bool {
	return w.publishResult(ctx, j, &celeryproto.Result{TaskID: j.msg.ID, Status: celeryproto.StateFailure,
		Exception: exc, Traceback: err.Error()})
}

// quarantinePoison answers a delivery that came too often (its task kept
// dying with its worker, or its operation never got an outcome) and
// quarantines it. The caller gets FAILURE WorkerLostError, as a Celery
// caller does whose task's worker process died.
func (w *Worker) quarantinePoison(ctx context.Context, j *job, cause error) {
	exc := &celeryproto.Exception{Type: "WorkerLostError", Module: "billiard.exceptions",
		Message: "quarantined as poison: " + cause.Error()}
	if w.replyFailure(ctx, j, exc, cause) {
		w.quarantine(ctx, j, ReasonPoison, cause)
	}
}

// quarantineUndecodable answers a delivery whose body cannot be read (or is
// pickle) when its caller can still be named, by the task id header (else
// the correlation id) and reply_to, and quarantines it. The caller gets
// FAILURE ContentDisallowed for pickle, DecodeError otherwise: what kombu
// raises for such a body.
func (w *Worker) quarantineUndecodable(ctx context.Context, j *job, cause error) {
	d := j.d
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

// ack acknowledges the delivery; a stale delivery (its channel is gone)
// comes back from the broker and is answered from the record then.
func (w *Worker) ack(j *job) {
	w.forget(j)
	if err := j.d.Ack(); err != nil {
		w.log.Info("ack failed; the broker redelivers the message", w.fields(j, zap.Error(err))...)
	}
}

// retry republishes a task that asked for a Celery retry (same id,
// retries+1, eta = now + countdown, everything else copied) with a confirm,
// tells the caller RETRY and acks. settle has already turned a retry past
// the task's MaxRetries into a failure.
func (w *Worker) retry(ctx context.Context, j *job, rr *RetryRequest) {
	next := *j.msg
	next.Retries++
	next.ETA = time.Now().Add(rr.Countdown)
	next.Headers = withoutBrokerHeaders(next.Headers)
	pub, err := celeryproto.EncodeTask(&next, celeryproto.EncodeOptions{Protocol: 2, Serializer: j.msg.Serializer()})
	if err != nil {
		w.log.Error("encode retry", w.fields(j, zap.Error(err))...)
		w.finish(ctx, j, nil, fmt.Errorf("cannot retry: %w", err))
		return
	}
	if err := w.publish(ctx, j.d.Exchange, j.d.RoutingKey, pub, amqp.PublishOptions{Mandatory: true}); err != nil {
		if amqp.IsPermanent(err) {
			w.publishRefused(ctx, j, fmt.Errorf("publish retry: %w", err))
			return
		}
		w.recordTrouble(ctx, j, "publish retry", err)
		return
	}
	w.m.retried.WithLabelValues(j.h.name).Inc()
	exc := &celeryproto.Exception{Type: "Retry", Module: "celery.exceptions", Message: rr.Error()}
	if w.wantEvents() {
		w.event(ctx, j, failedEvent("task-retried", j.h.name, exc))
	}
	if !w.publishResult(ctx, j, &celeryproto.Result{TaskID: j.msg.ID, Status: celeryproto.StateRetry, Exception: exc}) {
		return
	}
	w.ack(j)
}

// revokeDelivery answers a revoked or expired delivery: REVOKED to the
// caller, then ack.
func (w *Worker) revokeDelivery(ctx context.Context, j *job, expired bool) {
	w.m.revoked.WithLabelValues(j.h.name).Inc()
	msg := "revoked"
	if expired {
		msg = "expired"
	}
	w.log.Info("task "+msg, w.fields(j)...)
	if w.wantEvents() {
		w.event(ctx, j, &celeryproto.TaskEvent{Type: "task-revoked", Expired: expired})
	}
	exc := &celeryproto.Exception{Type: "TaskRevokedError", Module: "celery.exceptions", Message: msg}
	if w.publishResult(ctx, j, &celeryproto.Result{TaskID: j.msg.ID, Status: celeryproto.StateRevoked, Exception: exc}) {
		w.ack(j)
	}
}

// schedule holds a delivery unacknowledged until its ETA, growing the
// prefetch window by one for each held delivery so that they do not starve
// the others (as Celery does).
func (w *Worker) schedule(j *job, wait time.Duration) {
	if exp := j.msg.Expires; !exp.IsZero() && exp.Before(j.msg.ETA) {
		// It expires before it is due: answer it (REVOKED) when it expires.
		wait = min(wait, time.Until(exp)+time.Millisecond)
	}
	if mh := w.cfg.MaxHold; mh > 0 && wait > mh {
		wait, j.rehold = mh, true
	}
	w.mu.Lock()
	w.held[j] = struct{}{}
	w.scheduled++
	w.mu.Unlock()
	w.m.scheduled.Inc()
	w.applyPrefetch()
	w.laterThen(j, wait, func() {
		if w.unhold(j) {
			w.applyPrefetch()
		}
	})
}

// rehold ends a hold of Config.MaxHold before the delivery's ETA: a copy of
// the message goes to the queue it came from (default exchange, confirmed),
// then the delivery is acknowledged; the copy arrives as a fresh delivery
// and is held in its place. A crash in between leaves two copies with the
// same task id: the record answers the second.
func (w *Worker) rehold(ctx context.Context, j *job) {
	d := j.d
	p := &celeryproto.Publishing{
		ContentType: d.ContentType, ContentEncoding: d.ContentEncoding, Headers: withoutBrokerHeaders(d.Headers),
		Body: d.Body, CorrelationID: d.CorrelationID, ReplyTo: d.ReplyTo, DeliveryMode: 2, Priority: d.Priority,
	}
	if err := w.publish(ctx, "", d.Queue, p, amqp.PublishOptions{Mandatory: true}); err != nil {
		if amqp.IsPermanent(err) {
			w.publishRefused(ctx, j, fmt.Errorf("republish held delivery: %w", err))
			return
		}
		w.recordTrouble(ctx, j, "republish held delivery", err)
		return
	}
	if ce := w.log.Check(zap.DebugLevel, "held delivery republished (max hold reached before its ETA)"); ce != nil {
		ce.Write(w.fields(j, zap.Time("eta", j.msg.ETA))...)
	}
	w.ack(j)
}

// unhold removes j from the held set; it reports whether j was there.
func (w *Worker) unhold(j *job) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if _, ok := w.held[j]; !ok {
		return false
	}
	delete(w.held, j)
	w.scheduled--
	w.m.scheduled.Dec()
	return true
}

// applyPrefetch sets the consumer's prefetch to Config.Prefetch plus the
// deliveries held for their ETA. Calls are serialized and each applies the
// count of its time, so the last one wins with the latest count.
func (w *Worker) applyPrefetch() {
	w.qosMu.Lock()
	defer w.qosMu.Unlock()
	w.mu.Lock()
	n := w.cfg.Prefetch + w.scheduled
	w.mu.Unlock()
	if n > 65535 {
		n = 65535
	}
	if err := w.consumer.SetPrefetch(n); err != nil {
		w.log.Warn("set prefetch for ETA deliveries", zap.Int("prefetch", n), zap.Error(err))
	}
}

// dropStaleHeld forgets deliveries held for their ETA whose channel is gone
// (a reconnect, or the broker closing the channel at its consumer_timeout):
// the broker redelivers them, and their copies are held instead; the
// prefetch window shrinks back.
func (w *Worker) dropStaleHeld() {
	dropped := 0
	w.mu.Lock()
	for j := range w.held {
		if !j.d.Stale() {
			continue
		}
		if t, ok := w.timers[j]; ok {
			t.Stop()
			delete(w.timers, j)
		}
		delete(w.held, j)
		delete(w.reserved, j)
		w.scheduled--
		w.m.scheduled.Dec()
		dropped++
	}
	w.mu.Unlock()
	if dropped > 0 {
		w.log.Info("held ETA deliveries lost with their channel; the broker redelivers them", zap.Int("count", dropped))
		w.applyPrefetch()
	}
}

// fields are the log fields of a delivery: task name, id, operation key,
// retries; the argument reprs only when Config.LogArguments is set.
func (w *Worker) fields(j *job, extra ...zap.Field) []zap.Field {
	f := make([]zap.Field, 0, 6+len(extra))
	if j.msg != nil {
		// Bounded: a producer may send names of any length.
		f = append(f, zap.String("task", clip.String(j.msg.Task, maxLogField)), zap.String("task_id", clip.String(j.msg.ID, maxLogField)))
		if j.msg.Retries > 0 {
			f = append(f, zap.Int("retries", j.msg.Retries))
		}
		if w.cfg.LogArguments {
			f = append(f, zap.String("args", j.msg.ArgsRepr), zap.String("kwargs", j.msg.KwargsRepr))
		}
	}
	if j.key != "" {
		f = append(f, zap.String("key", clip.String(j.key, maxLogField)))
	}
	if j.attempt > 0 {
		f = append(f, zap.Int("attempt", j.attempt))
	}
	return append(f, extra...)
}

// heldMessage is the form of a delivery kept in a held record, so that it
// can be republished as it came (DecodeHeld).
type heldMessage struct {
	Exchange    string                  `json:"exchange"`
	RoutingKey  string                  `json:"routing_key"`
	Queue       string                  `json:"queue"`
	Publishing  *celeryproto.Publishing `json:"publishing"`
	CapturedAt  time.Time               `json:"captured_at"`
	Redelivered bool                    `json:"redelivered"`
}

// heldCopy encodes j's delivery for the held record it may go to, or keeps
// none (nil, logged) when it cannot be encoded (a header value JSON cannot
// hold): the operation is held all the same, without a message for
// 'onceler resolve --retry' to replay.
func (w *Worker) heldCopy(j *job) []byte {
	b, err := encodeHeld(j.d)
	if err != nil {
		w.log.Error("the held operation keeps no copy of its message: it cannot be encoded", w.fields(j, zap.Error(err))...)
		return nil
	}
	return b
}

func encodeHeld(d *amqp.Delivery) ([]byte, error) {
	h := heldMessage{Exchange: d.Exchange, RoutingKey: d.RoutingKey, Queue: d.Queue, CapturedAt: time.Now().UTC(),
		Redelivered: d.Redelivered, Publishing: &celeryproto.Publishing{
			ContentType: d.ContentType, ContentEncoding: d.ContentEncoding, Headers: d.Headers, Body: d.Body,
			CorrelationID: d.CorrelationID, ReplyTo: d.ReplyTo, DeliveryMode: 2, Priority: d.Priority,
		}}
	b, err := json.Marshal(h)
	if err != nil {
		return nil, fmt.Errorf("encode held message: %w", err)
	}
	return b, nil
}

// DecodeHeld reads the message kept in a held record (idempotency
// Record.Message, or what ResolveRetry returns) back into what to publish
// to replay it: the exchange and routing key it came by, and the message.
// Header values come back as JSON gives them (numbers as float64).
func DecodeHeld(b []byte) (exchange, routingKey string, p *celeryproto.Publishing, err error) {
	var h heldMessage
	if err := json.Unmarshal(b, &h); err != nil {
		return "", "", nil, fmt.Errorf("decode held message: %w", err)
	}
	if h.Publishing == nil {
		return "", "", nil, fmt.Errorf("decode held message: no message")
	}
	rk := h.RoutingKey
	if h.Exchange == "" && h.Queue != "" {
		rk = h.Queue
	}
	return h.Exchange, rk, h.Publishing, nil
}

// withoutBrokerHeaders returns h without the headers the broker sets on a
// delivery (x-delivery-count, dead-lettering history): a new message that
// copies them would look redelivered (a quorum queue's delivery count is
// what the poison check reads). h itself is not changed.
func withoutBrokerHeaders(h map[string]any) map[string]any {
	drop := func(k string) bool {
		return k == "x-delivery-count" || k == "x-death" || strings.HasPrefix(k, "x-first-death-") ||
			strings.HasPrefix(k, "x-last-death-")
	}
	n := 0
	for k := range h {
		if drop(k) {
			n++
		}
	}
	if n == 0 {
		return h
	}
	out := make(map[string]any, len(h)-n)
	for k, v := range h {
		if !drop(k) {
			out[k] = v
		}
	}
	return out
}
