package tasks

import (
	"context"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/clip"
	"github.com/onceler/onceler/internal/pause"
	"github.com/onceler/onceler/internal/workerhooks"
)

// chordBackend is a result backend that keeps chord counters (Redis,
// django-db), as Celery's backends with on_chord_part_return.
type chordBackend interface {
	// chordPart adds a header part's join entry to its chord (group gid,
	// position index; nil: after the others) and reports whether this part
	// publishes the body, with the joined entries in header order: true
	// for the part that completed the header, and again for a redelivery
	// of that same part while the chord is not marked done.
	chordPart(ctx context.Context, gid, taskID string, index *int, entry []byte) (fire bool, joined [][]byte, err error)
	// chordDone forgets the chord's counters once its body is published.
	chordDone(ctx context.Context, gid string) error
}

// workflowRefusal says why the message's workflow cannot be carried out, or
// "" when it can: unsupportedWorkflow, except that a chord part is
// accepted when the result backend keeps chord counters and its body is a
// plain task signature.
func (w *Worker) workflowRefusal(m *celeryproto.Message) string {
	if m.Chord == nil {
		return unsupportedWorkflow(m)
	}
	if _, ok := w.backend.(chordBackend); !ok {
		return unsupportedWorkflow(m)
	}
	if t := m.Chord.SubtaskType; t != "" {
		return fmt.Sprintf("a chord body of type %q is not supported (a plain task signature only)", t)
	}
	c := *m
	c.Chord = nil
	return unsupportedWorkflow(&c)
}

// chordPartReturn is Celery's RedisBackend.on_chord_part_return for the
// delivery j, a chord header part whose ready result r is stored: its
// entry joins the chord's, and the part that completes the header
// publishes the body with the results in header order, or, when a part
// failed, gives the body's errbacks and the body's result a ChordError. It
// reports whether the delivery may be acknowledged (false: given back).
func (w *Worker) chordPartReturn(ctx context.Context, j *job, r *celeryproto.Result) bool {
	m := j.msg
	cb, ok := w.backend.(chordBackend)
	if !ok || m == nil || m.Chord == nil || m.GroupID == "" || m.ID == "" || r.TaskID != m.ID {
		return true
	}
	if r.Status != celeryproto.StateSuccess && r.Status != celeryproto.StateFailure && r.Status != celeryproto.StateRevoked {
		return true
	}
	pr := *r
	pr.Serializer = w.cfg.ResultSerializer
	entry, err := celeryproto.EncodeChordPart(&pr)
	if err != nil {
		w.log.Error("chord part cannot be encoded; its chord cannot complete", w.fields(j, zap.Error(err))...)
		return true
	}
	var fire bool
	var joined [][]byte
	if !w.retryBackend(ctx, j, "chord part", func(ctx context.Context) error {
		var err error
		fire, joined, err = cb.chordPart(ctx, m.GroupID, m.ID, m.GroupIndex, entry)
		return err
	}) {
		return false
	}
	if !fire {
		return true
	}
	if j.h != nil {
		w.crash(workerhooks.ChordJoined, j)
	}
	results := make([]any, 0, len(joined))
	var failed *celeryproto.ChordPart
	for _, e := range joined {
		p, err := celeryproto.DecodeChordPart(w.cfg.ResultSerializer, e)
		if err != nil {
			return w.chordError(ctx, j, cb, fmt.Sprintf("Join error: %v", err))
		}
		if p.Propagates() && failed == nil {
			failed = p
		}
		results = append(results, p.Value)
	}
	if failed != nil {
		return w.chordError(ctx, j, cb, fmt.Sprintf("Dependency %s raised %s", failed.TaskID, failed.ExceptionRepr()))
	}
	s, err := w.buildStep(j, "chord", 0, *m.Chord, []any{results}, nil)
	if err != nil {
		return w.chordError(ctx, j, cb, fmt.Sprintf("Callback error: %v", err))
	}
	if err := w.publishSteps(ctx, j, []step{s}); err != nil {
		if amqp.IsPermanent(err) {
			return w.chordError(ctx, j, cb, fmt.Sprintf("Callback error: %v", err))
		}
		// Not published: the redelivery of this part publishes it.
		w.log.Warn("chord body not published; delivery requeued", w.fields(j, zap.String("error", clip.String(err.Error(), maxLogField)))...)
		w.giveBack(j)
		return false
	}
	w.forgetChord(ctx, j, cb)
	return true
}

// chordError is Celery's chord_error_from_stack for the chord of j's
// header: the body's link_error errbacks with the body's task id (Celery's
// old-style errback call), then FAILURE celery.exceptions.ChordError(msg)
// stored as the body's result.
func (w *Worker) chordError(ctx context.Context, j *job, cb chordBackend, msg string) bool {
	body := *j.msg.Chord
	bodyID := body.TaskID()
	w.log.Warn("chord failed; its body gets ChordError", w.fields(j, zap.String("body", clip.String(body.Task, maxLogField)),
		zap.String("body_id", clip.String(bodyID, maxLogField)), zap.String("error", clip.String(msg, maxLogField)))...)
	errbacks, err := optSignatures(body.Options, "link_error")
	if err != nil {
		w.log.Error("chord body errbacks cannot be read", w.fields(j, zap.Error(err))...)
	}
	var steps []step
	for i, sig := range errbacks {
		s, err := w.expandStep(j, "chord-errback", i, sig, []any{bodyID}, nil)
		if err != nil {
			w.log.Error("chord body errback cannot be built", w.fields(j, zap.Error(err))...)
			continue
		}
		for k := range s {
			s[k].msg.ParentID = bodyID
		}
		steps = append(steps, s...)
	}
	if len(steps) > 0 {
		if err := w.publishSteps(ctx, j, steps); err != nil && !amqp.IsPermanent(err) {
			w.log.Warn("chord errbacks not published; delivery requeued", w.fields(j, zap.String("error", clip.String(err.Error(), maxLogField)))...)
			w.giveBack(j)
			return false
		} else if err != nil {
			w.log.Error("chord errback refused by the broker", w.fields(j, zap.String("error", clip.String(err.Error(), maxLogField)))...)
		}
	}
	if bodyID != "" {
		exc := &celeryproto.Exception{Type: "ChordError", Module: "celery.exceptions", Message: msg}
		if !w.storeResult(ctx, j, &celeryproto.Result{TaskID: bodyID, Status: celeryproto.StateFailure, Exception: exc, Traceback: msg}) {
			return false
		}
	}
	w.forgetChord(ctx, j, cb)
	return true
}

// forgetChord deletes the counters of j's chord once its body (or its
// ChordError) is out; counters left behind expire with the results.
func (w *Worker) forgetChord(ctx context.Context, j *job, cb chordBackend) {
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := cb.chordDone(dctx, j.msg.GroupID); err != nil {
		w.log.Warn("chord counters not deleted; they expire", w.fields(j, zap.String("error", clip.String(err.Error(), maxLogField)))...)
	}
}

// retryBackend runs op against the result backend until it succeeds, as
// storeResult retries a result: false when the worker stops first (the
// delivery was given back).
func (w *Worker) retryBackend(ctx context.Context, j *job, what string, op func(context.Context) error) bool {
	for attempt := 0; ; attempt++ {
		pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), opTimeout)
		err := op(pctx)
		cancel()
		if err == nil {
			return true
		}
		if w.backend.permanent(err) {
			// Refused the same every time: the chord cannot go on from this
			// part; said once, and the delivery goes on (its own result is
			// stored).
			w.log.Error("result backend "+what+" refused; the chord cannot complete from this part", w.fields(j,
				zap.Stringer("backend", w.backend), zap.String("error", clip.String(err.Error(), maxLogField)))...)
			return true
		}
		if attempt%10 == 0 {
			w.log.Warn("result backend "+what+" failed; retrying, delivery held unacknowledged", w.fields(j,
				zap.Stringer("backend", w.backend), zap.Int("write_attempt", attempt+1),
				zap.String("error", clip.String(err.Error(), maxLogField)))...)
		}
		if ctx.Err() != nil || !pause.For(ctx, min(50*time.Millisecond<<min(attempt, 5), time.Second)) {
			w.log.Warn(what+" not stored; delivery requeued", w.fields(j, zap.String("error", clip.String(err.Error(), maxLogField)))...)
			w.giveBack(j)
			return false
		}
	}
}
