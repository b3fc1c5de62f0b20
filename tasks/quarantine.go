package tasks

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/onceler/onceler/amqp"
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

// quarantine moves the delivery to its queue's quarantine queue (published
// with a confirm and the reason in HeaderReason) and then acknowledges it.
// If the move fails the delivery stays unacknowledged and is tried again,
// at growing intervals up to 30 s; a copy the broker refuses for what it is
// goes again without the original headers.
func (w *Worker) quarantine(ctx context.Context, j *job, reason string, cause error) {
	d := j.d
	if j.verdict == nil {
		w.m.quarantined.WithLabelValues(reason).Inc()
	}
	fields := []zap.Field{zap.String("reason", reason), zap.String("queue", d.Queue), zap.String("error", clip.String(cause.Error(), maxLogField))}
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
		HeaderQueue:  d.Queue,
		HeaderTime:   time.Now().UTC().Format(time.RFC3339Nano),
	}
	if celeryproto.IsDecodeError(cause) {
		ours[HeaderDecodeReason] = celeryproto.Reason(cause)
	}
	p := &celeryproto.Publishing{
		ContentType: d.ContentType, ContentEncoding: d.ContentEncoding, Headers: fitHeaders(d.Headers, ours), Body: d.Body,
		CorrelationID: d.CorrelationID, ReplyTo: d.ReplyTo, DeliveryMode: 2, Priority: d.Priority,
	}
	err := w.publish(ctx, "", quarantineName(d.Queue), p, amqp.PublishOptions{Mandatory: true})
	if amqp.IsPermanent(err) {
		// Only the copy's own headers: the original ones could not go.
		ours[HeaderTruncated] = clip.String("all original headers left out: "+err.Error(), maxDetail)
		p.Headers = ours
		err = w.publish(ctx, "", quarantineName(d.Queue), p, amqp.PublishOptions{Mandatory: true})
	}
	if err != nil {
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

// fitHeaders returns the headers of a quarantine copy: the delivery's
// headers h with ours added, cut to maxQuarantineHeaders when they do not
// fit (HeaderTruncated then says what was cut). h is not changed.
func fitHeaders(h, ours map[string]any) map[string]any {
	out := make(map[string]any, len(h)+len(ours)+1)
	for k, v := range h {
		out[k] = v
	}
	for k, v := range ours {
		out[k] = v
	}
	if n, err := amqp.HeadersSize(out); err == nil && n <= maxQuarantineHeaders {
		return out
	}
	out = make(map[string]any, len(ours)+1)
	for k, v := range ours {
		out[k] = v
	}
	used, _ := amqp.HeadersSize(out)
	used += maxDetail + 64 // HeaderTruncated
	keys := make([]string, 0, len(h))
	for k := range h {
		if _, mine := ours[k]; !mine {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	var cut, left []string
	for _, k := range keys {
		v := h[k]
		n, err := amqp.HeadersSize(map[string]any{k: v})
		if err != nil || n > maxQuarantineValue+len(k)+16 {
			v = cutValue(v)
			cut = append(cut, fmt.Sprintf("%s (%d bytes)", k, n))
			n, _ = amqp.HeadersSize(map[string]any{k: v})
		}
		if used+n > maxQuarantineHeaders {
			left = append(left, k)
			continue
		}
		out[k] = v
		used += n
	}
	var b strings.Builder
	fmt.Fprintf(&b, "headers cut to fit a frame (each to %d bytes, %d in all)", maxQuarantineValue, maxQuarantineHeaders)
	if len(cut) > 0 {
		b.WriteString("; cut: " + strings.Join(cut, ", "))
	}
	if len(left) > 0 {
		b.WriteString("; left out: " + strings.Join(left, ", "))
	}
	out[HeaderTruncated] = clip.String(b.String(), maxDetail)
	return out
}

// cutValue is a header value cut to maxQuarantineValue bytes: text and
// bytes keep their first bytes, other values become their text form, cut.
func cutValue(v any) any {
	switch x := v.(type) {
	case string:
		return clip.String(x, maxQuarantineValue)
	case []byte:
		return clip.String(string(x), maxQuarantineValue)
	}
	return clip.String(fmt.Sprint(v), maxQuarantineValue)
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
