package tasks

// Stage 2, bind. Receives a decoded job (j.msg). Hands on the job bound to
// its registered task (j.h), its arguments (j.args, bound to the task's
// struct by bind.go), its operation key (j.key) and its argument fingerprint
// (j.fp). An unknown task, bad arguments or a workflow the worker does not
// carry out is answered and quarantined here.

import (
	"context"
	"errors"
	"fmt"

	"go.uber.org/zap"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/clip"
)

// bind finds j's task in the registry, binds its arguments, derives its
// operation key and its argument fingerprint. It answers the delivery
// (FAILURE, quarantine) and returns false when the delivery cannot run.
func (w *Worker) bind(ctx context.Context, j *job) bool {
	msg := j.msg
	h, ok := w.reg.get(msg.Task)
	if !ok {
		w.m.received.WithLabelValues("unregistered").Inc()
		w.log.Error("received unregistered task", zap.String("task", clip.String(msg.Task, maxLogField)), zap.String("task_id", clip.String(msg.ID, maxLogField)))
		exc := &celeryproto.Exception{Type: "NotRegistered", Module: "celery.exceptions", Message: msg.Task}
		if w.wantEvents() {
			// As Celery's consumer (on_unknown_task): task-failed, no
			// task-received.
			w.event(ctx, j, failedEvent("task-failed", msg.Task, exc))
		}
		// Even under ignore_result, as Celery does (only SUCCESS is dropped).
		if !w.publishResult(ctx, j, &celeryproto.Result{TaskID: msg.ID, Status: celeryproto.StateFailure, Exception: exc}) {
			return false
		}
		w.quarantine(ctx, j, ReasonUnknownTask, fmt.Errorf("task %q is not registered", msg.Task))
		return false
	}
	j.h = h
	w.taskMetricsOf(h).receivedOf(w.m, h.name).Inc()
	if w.wantEvents() && !w.isRevoked(msg.ID) && !expired(msg) {
		// A revoked or expired message gets task-revoked alone, as from
		// Celery, whose worker looks at both before announcing a task.
		w.event(ctx, j, receivedEvent(j))
	}
	args, err := h.bind(msg.Args, msg.Kwargs)
	if err == nil && h.key != nil {
		j.key, err = j.operationKey(args)
	}
	if err != nil {
		var ae *ArgumentError
		if errors.As(err, &ae) {
			ae.Task = h.name
		}
		w.log.Warn("bad arguments", w.fields(j, zap.String("error", clip.String(err.Error(), maxLogField)))...)
		exc := exceptionFor(err)
		if w.wantEvents() {
			w.event(ctx, j, failedEvent("task-failed", h.name, exc))
		}
		// As Celery's TypeError from the call: the failure goes along the
		// workflow too.
		if !w.replyFailure(ctx, j, exc, err) || !w.failWorkflow(ctx, j, exc, err.Error()) {
			return false
		}
		w.quarantine(ctx, j, ReasonBadArguments, err)
		return false
	}
	j.args = args
	if why := w.workflowRefusal(msg); why != "" {
		w.refuseWorkflow(ctx, j, why)
		return false
	}
	if h.mode != ModePure && !w.cfg.hooks.NoRecord && !h.allowMismatch {
		fp, err := celeryproto.Fingerprint(msg.Args, msg.Kwargs)
		if err != nil {
			w.quarantine(ctx, j, ReasonBadArguments, fmt.Errorf("fingerprint: %w", err))
			return false
		}
		j.fp = fp
	}
	return true
}

// operationKey is the idempotency_key header when the producer sent one,
// else the task's Key function of the arguments; it must be text the record
// can keep: UTF-8 without NUL, at most idempotency.MaxKeyBytes (the
// database would refuse every claim of it).
func (j *job) operationKey(args any) (string, error) {
	key, err := j.rawOperationKey(args)
	switch {
	case err != nil:
	case !celeryproto.StorableText(key):
		err = &ArgumentError{Reason: "operation key must be UTF-8 text without NUL"}
	case len(key) > idempotency.MaxKeyBytes:
		err = &ArgumentError{Reason: fmt.Sprintf("operation key of %d bytes: the record keeps keys of at most %d bytes",
			len(key), idempotency.MaxKeyBytes)}
	}
	return key, err
}

func (j *job) rawOperationKey(args any) (string, error) {
	if v, ok := j.msg.Headers["idempotency_key"]; ok && v != nil {
		switch k := v.(type) {
		case string:
			if k != "" {
				return k, nil
			}
		case []byte:
			if len(k) > 0 {
				return string(k), nil
			}
		}
		return "", &ArgumentError{Arg: "idempotency_key", Reason: "header must be a non-empty string"}
	}
	key, err := j.h.key(args)
	if err != nil {
		return "", &ArgumentError{Reason: "operation key: " + err.Error()}
	}
	if key == "" {
		return "", &ArgumentError{Reason: "operation key is empty"}
	}
	return key, nil
}
