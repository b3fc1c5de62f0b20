package tasks

// Stage 7, answer. Receives a job whose outcome is recorded (or that has no
// record): a result, a task error, a retry request, a duplicate's stored
// result, a revoke. Sends the task events, the workflow's next steps
// (workflow.go) and the result to the caller, by rpc:// or the result
// backend (backend.go), then hands the job to the ack stage. A result that
// cannot be sent while the worker runs leaves the delivery unacknowledged.

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/clip"
	"github.com/onceler/onceler/internal/pause"
	"github.com/onceler/onceler/internal/workerhooks"
	"github.com/onceler/onceler/sidekiq"
)

// finish answers a delivery whose outcome is recorded (or that has no
// record): the result to the caller, then the ack.
func (w *Worker) finish(ctx context.Context, j *job, res []byte, taskErr error) {
	if w.lostWhileRunning(j, taskErr == nil && j.completed) {
		w.taskMetricsOf(j.h).succeededOf(w.m, j.h.name).Inc()
		return
	}
	msg := j.msg
	if taskErr == nil {
		w.taskMetricsOf(j.h).succeededOf(w.m, j.h.name).Inc()
		if ce := w.log.Check(zap.DebugLevel, "task succeeded"); ce != nil {
			ce.Write(w.fields(j)...)
		}
		if w.wantEvents() {
			w.event(ctx, j, succeededEvent(res, j.runtime.Seconds(), false))
		}
		// Workflow steps (link callbacks, the chain's next step) go out, with
		// a confirm, before the result: Celery publishes them before it
		// stores SUCCESS.
		if !w.followUp(ctx, j, res) || !w.replySuccess(ctx, j, res) {
			return
		}
		w.crash(workerhooks.BeforeAck, j)
		w.ack(j)
		return
	}
	var rr *RetryRequest
	if errors.As(taskErr, &rr) {
		w.retry(ctx, j, rr)
		return
	}
	if errors.Is(taskErr, ErrRevoked) {
		w.m.revoked.WithLabelValues(j.h.name).Inc()
		w.log.Info("running task terminated by revoke", w.fields(j)...)
		if w.wantEvents() {
			w.event(ctx, j, &celeryproto.TaskEvent{Type: "task-revoked", Terminated: true, Signum: 15})
		}
		exc := &celeryproto.Exception{Type: "TaskRevokedError", Module: "celery.exceptions", Message: "terminated"}
		if w.publishResult(ctx, j, &celeryproto.Result{TaskID: msg.ID, Status: celeryproto.StateRevoked, Exception: exc}) {
			w.ack(j)
		}
		return
	}
	w.taskMetricsOf(j.h).failedOf(w.m, j.h.name).Inc()
	var pe *PanicError
	if errors.As(taskErr, &pe) {
		w.log.Error("task panicked", w.fields(j, zap.Any("panic", pe.Value), zap.ByteString("stack", pe.Stack))...)
	} else {
		w.log.Info("task failed", w.fields(j, zap.Error(taskErr))...)
	}
	exc := exceptionFor(taskErr)
	if errors.Is(taskErr, ErrTimeLimit) {
		exc = &celeryproto.Exception{Type: "TimeLimitExceeded", Module: "billiard.exceptions", Message: strconv.FormatFloat(j.hardLimit().Seconds(), 'g', -1, 64)}
	}
	tb := j.taskTraceback(exc, taskErr)
	if w.wantEvents() {
		ev := failedEvent("task-failed", j.h.name, exc)
		ev.Traceback = tb
		w.event(ctx, j, ev)
	}
	r := &celeryproto.Result{TaskID: msg.ID, Status: celeryproto.StateFailure, Exception: exc, Traceback: tb}
	if !w.publishResult(ctx, j, r) || !w.failWorkflow(ctx, j, exc, tb) {
		return
	}
	w.crash(workerhooks.BeforeAck, j)
	if fd, ok := j.d.(failingDelivery); ok {
		w.settleFailed(ctx, j, fd, sidekiqClassOf(exc), exc.Message, strings.Split(strings.TrimRight(tb, "\n"), "\n"))
		return
	}
	w.ack(j)
}

// lostWhileRunning reports whether j's delivery was lost while its task ran
// or waited (its channel closed: a connection loss, or RabbitMQ's
// consumer_timeout) and its answer is left to the redelivery: then the
// job is forgotten, nothing sent. It is left only when the redelivery is
// sure to come and to be answered from the record as this run would
// answer (redeliveryAnswers): completed says the record holds this run's
// outcome as completed (a success; a duplicate's stored result). In every
// other case (a failure, a retry, no record, a message the broker may
// drop or dead-letter) the run answers as if its delivery were live: its
// ack fails, and a redelivery, if one comes, is answered again.
func (w *Worker) lostWhileRunning(j *job, completed bool) bool {
	if !j.d.stale() {
		return false
	}
	if why := w.redeliveryAnswers(j, completed); why != "" {
		w.log.Info("delivery lost while the task ran (its channel closed); answered here all the same: "+why,
			w.fields(j, zap.Duration("runtime", j.runtime))...)
		return false
	}
	w.log.Info("delivery lost while the task ran (its channel closed); not answered here: its redelivery is answered from the record",
		w.fields(j, zap.Duration("runtime", j.runtime))...)
	w.forget(j)
	return true
}

// redeliveryAnswers returns "" when the redelivery of j's lost delivery is
// sure to come and to be answered from the record, else why not: the
// record holds the outcome as completed (completed); the message is
// persistent (delivery_mode 2: it survives a broker restart), has no
// per-message TTL (the broker would drop it when it goes back past it) and
// no Celery expires (the redelivery would be answered REVOKED); and the
// redelivery is not the broker's last (x-delivery-limit: the decode stage
// quarantines that one unrun) nor past Config.MaxAttempts.
func (w *Worker) redeliveryAnswers(j *job, completed bool) string {
	wire := j.d.wire()
	n, lim := j.d.deliveryCount(), j.d.deliveryLimit()
	switch {
	case !completed:
		return "its outcome is not a completed record a redelivery answers from"
	case wire.DeliveryMode != 2:
		return "its message is not persistent: no redelivery after a broker restart"
	case wire.Expiration != "":
		return "its message has a TTL: the broker may drop it on its way back"
	case j.msg != nil && !j.msg.Expires.IsZero():
		return "its message has an expiry: its redelivery may be answered REVOKED"
	case lim > 0 && n+1 >= lim:
		return "its redelivery is the queue's last (x-delivery-limit)"
	case n+1 > w.cfg.MaxAttempts:
		return "its redelivery is past the delivery limit (MaxAttempts)"
	}
	return ""
}

// duplicate answers a delivery of an operation already completed: the stored
// result to this delivery's caller, then ack.
func (w *Worker) duplicate(ctx context.Context, j *job, stored []byte) {
	if w.lostWhileRunning(j, true) {
		return
	}
	w.m.duplicates.WithLabelValues(j.h.name).Inc()
	if ce := w.log.Check(zap.DebugLevel, "duplicate suppressed"); ce != nil {
		ce.Write(w.fields(j)...)
	}
	if w.wantEvents() {
		w.event(ctx, j, succeededEvent(stored, 0, true))
	}
	if !w.followUp(ctx, j, stored) || !w.replySuccess(ctx, j, stored) {
		return
	}
	w.ack(j)
}

// retry sends the next try of a task that asked for a Celery retry (same
// id, retries+1, eta = now + countdown, everything else copied) through
// its delivery (the AMQP transport: a new message, confirmed), tells the
// caller RETRY and acks. settle has already turned a retry past
// the task's MaxRetries into a failure.
func (w *Worker) retry(ctx context.Context, j *job, rr *RetryRequest) {
	next := *j.msg
	next.Retries++
	next.ETA = time.Now().Add(rr.Countdown)
	if err := j.d.retry(ctx, &next, rr); err != nil {
		var ee *encodeError
		switch {
		case errors.As(err, &ee):
			w.log.Error("encode retry", w.fields(j, zap.Error(err))...)
			w.finish(ctx, j, nil, fmt.Errorf("cannot retry: %w", err))
		case amqp.IsPermanent(err):
			w.publishRefused(ctx, j, fmt.Errorf("publish retry: %w", err))
		default:
			w.recordTrouble(ctx, j, "publish retry", err)
		}
		return
	}
	exc := &celeryproto.Exception{Type: "Retry", Module: "celery.exceptions", Message: rr.Error()}
	if out, ok := w.retryOutcome(j); ok && out != sidekiq.Retried {
		// Sidekiq ended the job (its retries used up, retry: false): it
		// does not run again, so the caller is told it failed.
		w.log.Warn("retry asked for, but Sidekiq ended the job", w.fields(j, zap.Stringer("outcome", out))...)
		if w.wantEvents() {
			w.event(ctx, j, failedEvent("task-failed", j.h.name, exc))
		}
		if !w.publishResult(ctx, j, &celeryproto.Result{TaskID: j.msg.ID, Status: celeryproto.StateFailure, Exception: exc}) {
			return
		}
		w.ack(j)
		return
	}
	w.m.retried.WithLabelValues(j.h.name).Inc()
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

// opTimeout bounds one publish or one final record write.
const opTimeout = 30 * time.Second

// maxShortString is the longest AMQP short string (correlation_id,
// reply_to, names), in bytes.
const maxShortString = 255

// publish publishes with a confirm, bounded by opTimeout, which does not
// run out while the broker blocks publishing (a resource alarm): a
// result, a workflow step or a retry waits out the alarm rather than be
// sent again after it. A publish cut short by the end of the grace period
// leaves the delivery unacknowledged: its redelivery is answered from the
// record.
func (w *Worker) publish(ctx context.Context, exchange, key string, p *celeryproto.Publishing, o amqp.PublishOptions) error {
	o.Timeout = opTimeout
	return w.pub.Publish(ctx, exchange, key, p, o)
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

// jsonValue turns stored JSON into a value the result encoder writes back
// unchanged (integers stay integers).
func jsonValue(b []byte) (any, error) {
	if len(b) == 0 {
		return nil, nil
	}
	v, err := celeryproto.DecodeJSON(b)
	if err != nil {
		return nil, fmt.Errorf("decode stored result: %w", err)
	}
	return v, nil
}
