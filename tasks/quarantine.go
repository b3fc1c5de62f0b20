package tasks

import (
	"context"
	"time"

	"go.uber.org/zap"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/clip"
)

// HeaderTruncated is set on a quarantine copy whose headers were cut to fit
// a frame: it names the headers cut (to maxQuarantineValue bytes) and those
// left out.
const HeaderTruncated = "x-onceler-truncated"

// Quarantine reasons, the value of the x-onceler-reason header.
const (
	ReasonUndecodable  = "undecodable"
	ReasonUnknownTask  = "unknown_task"
	ReasonBadArguments = "bad_arguments"
	ReasonMismatch     = "fingerprint_mismatch"
	ReasonPoison       = "poison"
	// ReasonRefused: the record's database refused what the message asked
	// it to keep, and would refuse it again.
	ReasonRefused = "refused_by_record"
)

// Reasons are the quarantine reasons a worker gives, in the order of the
// pipeline's checks.
var Reasons = []string{ReasonUndecodable, ReasonPoison, ReasonUnknownTask, ReasonBadArguments,
	ReasonUnsupported, ReasonMismatch, ReasonRefused, ReasonPublishRefused}

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
	// HeaderDeliveries is the number of deliveries of a message before it
	// was republished on the last delivery its quorum queue's
	// x-delivery-limit allows (stage_decode.go): the worker counts it with
	// the copy's own x-delivery-count against Config.MaxAttempts.
	HeaderDeliveries = "x-onceler-deliveries"
)

// Bounds of a quarantine copy. A delivery's headers may fill its frame
// (128 KiB by default); the copy adds its own, so it could not be
// published as it is.
const (
	// maxQuarantineHeaders bounds the headers of a quarantine copy, in
	// bytes as encoded on the wire: they are kept whole when they fit,
	// else each original header larger than maxQuarantineValue is cut to
	// it and those that still do not fit are left out.
	maxQuarantineHeaders = 64 << 10
	// maxQuarantineValue bounds one cut header value, in bytes.
	maxQuarantineValue = 1 << 10
	// maxDetail bounds the quarantine header HeaderDetail, in bytes.
	maxDetail = 4096
	// maxLogField bounds a name or an error written to a log line, in
	// bytes.
	maxLogField = 512
)

// quarantine puts the delivery aside through its transport, with the
// reason in HeaderReason (the AMQP transport: a confirmed copy to its
// queue's quarantine queue, amqpDelivery.quarantine), and then
// acknowledges it. If the move fails the delivery stays unacknowledged and
// is tried again, at growing intervals up to 30 s.
func (w *Worker) quarantine(ctx context.Context, j *job, reason string, cause error) {
	queue := j.d.origin().Queue
	if j.verdict == nil {
		w.m.quarantined.WithLabelValues(reason).Inc()
	}
	fields := []zap.Field{zap.String("reason", reason), zap.String("queue", queue), zap.String("error", clip.String(cause.Error(), maxLogField))}
	if j.msg != nil {
		fields = append(fields, zap.String("task", clip.String(j.msg.Task, maxLogField)), zap.String("task_id", clip.String(j.msg.ID, maxLogField)))
	}
	if j.verdict == nil {
		w.log.Warn("quarantining message", fields...)
	}
	ours := map[string]any{
		HeaderReason: reason,
		// Bounded: the cause may repeat a name from the message (a task or
		// an argument) of any length.
		HeaderDetail: clip.String(cause.Error(), maxDetail),
		HeaderQueue:  queue,
		HeaderTime:   time.Now().UTC().Format(time.RFC3339Nano),
	}
	if celeryproto.IsDecodeError(cause) {
		ours[HeaderDecodeReason] = celeryproto.Reason(cause)
	}
	if err := j.d.quarantine(ctx, ours); err != nil {
		if ctx.Err() != nil {
			w.giveBack(j)
			return
		}
		if j.verdict == nil {
			w.log.Error("quarantine publish failed; delivery kept and tried again", append(fields,
				zap.String("publish_error", clip.String(err.Error(), maxLogField)))...)
			j.verdict = &verdict{reason: reason, cause: cause}
			j.checks = 0
		} else if ce := w.log.Check(zap.DebugLevel, "quarantine publish failed again"); ce != nil {
			ce.Write(append(fields, zap.String("publish_error", clip.String(err.Error(), maxLogField)))...)
		}
		delay := min(time.Second<<min(j.checks, 5), 30*time.Second)
		j.checks++
		w.later(j, delay)
		return
	}
	w.ack(j)
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
