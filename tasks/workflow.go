package tasks

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/clip"
	"github.com/onceler/onceler/internal/uuid"
)

// ReasonPublishRefused is the quarantine reason of a message whose
// workflow step, link, errback, retry or re-hold the broker refused for
// what it is (a missing exchange, a reserved or too long name, a copy
// larger than a frame, no queue bound for it): publishing it again could
// never succeed, so the caller is told FAILURE
// onceler.exceptions.PublishRefused and the task is not run again.
const ReasonPublishRefused = "publish_refused"

// ReasonUnsupported is the quarantine reason of a message whose workflow
// onceler cannot carry out: a chord part (onceler keeps no chord
// counters) or a chain, link or errback step that is itself a
// group, chain or chord.
const ReasonUnsupported = "unsupported_workflow"

// step is one workflow message to publish: a chain's next step, a link
// callback or a link_error errback.
type step struct {
	kind       string // "chain", "link" or "errback"
	msg        *celeryproto.Message
	exchange   string
	routingKey string
	queue      string // the queue routingKey names on the default exchange, "" otherwise
}

// unsupportedWorkflow says why the message's workflow cannot be carried
// out, or "" when it can.
func unsupportedWorkflow(m *celeryproto.Message) string {
	if m.Chord != nil {
		return "chord parts are not supported: onceler keeps no chord counters (with rpc:// Celery has none either)"
	}
	for _, l := range []struct {
		name string
		sigs []celeryproto.Signature
	}{{"chain", m.Chain}, {"link", m.Callbacks}, {"link_error", m.Errbacks}} {
		for i, s := range l.sigs {
			switch s.SubtaskType {
			case "":
				continue
			case "group":
				if _, err := groupMembers(s); err != nil {
					return fmt.Sprintf("a %s group step is not supported: %v", l.name, err)
				}
				if l.name == "chain" && i == len(l.sigs)-1 && i > 0 {
					return "a group followed by more chain steps is a chord, which is not supported"
				}
			default:
				return fmt.Sprintf("a %s step of type %q is not supported (plain task signatures and groups of them only)", l.name, s.SubtaskType)
			}
		}
	}
	return ""
}

// groupMembers returns the task signatures of a group signature
// (kwargs.tasks); they must be plain task signatures.
func groupMembers(g celeryproto.Signature) ([]celeryproto.Signature, error) {
	list, ok := g.Kwargs["tasks"].([]any)
	if !ok {
		return nil, errors.New("group without a list of tasks")
	}
	out := make([]celeryproto.Signature, 0, len(list))
	for _, e := range list {
		m, ok := e.(map[string]any)
		if !ok {
			return nil, errors.New("group member is not a signature")
		}
		s, err := sigFrom(m)
		if err != nil {
			return nil, fmt.Errorf("group member: %w", err)
		}
		if s.SubtaskType != "" {
			return nil, fmt.Errorf("group member of type %q", s.SubtaskType)
		}
		out = append(out, s)
	}
	return out, nil
}

// successSteps are the steps to publish after j succeeded with result, as
// Celery's worker does (celery/app/trace.py): each link callback with
// (result,) prepended, then the chain's next step (the last element) with
// (result,) prepended unless immutable and the rest of the chain. A group
// step stands for its members, each with (result,) prepended.
func (w *Worker) successSteps(j *job, result any) ([]step, error) {
	m := j.msg
	var out []step
	for i, sig := range m.Callbacks {
		s, err := w.expandStep(j, "link", i, sig, []any{result}, nil)
		if err != nil {
			return nil, err
		}
		out = append(out, s...)
	}
	if n := len(m.Chain); n > 0 {
		s, err := w.expandStep(j, "chain", 0, m.Chain[n-1], []any{result}, m.Chain[:n-1])
		if err != nil {
			return nil, err
		}
		out = append(out, s...)
	}
	return out, nil
}

// errbackSteps are the link_error errbacks of a failed j, each with the
// failed task's id prepended (Celery's old-style errback call, the one it
// uses for errbacks it cannot call in-process).
func (w *Worker) errbackSteps(j *job) ([]step, error) {
	var out []step
	for i, sig := range j.msg.Errbacks {
		s, err := w.expandStep(j, "errback", i, sig, []any{j.msg.ID}, nil)
		if err != nil {
			return nil, err
		}
		out = append(out, s...)
	}
	return out, nil
}

// expandStep builds the messages of one step: a task signature's, or each
// member's of a group (Celery's group.apply_async: group_id = the group's
// task id, group_index = the member's position).
func (w *Worker) expandStep(j *job, kind string, index int, sig celeryproto.Signature, prepend []any,
	chain []celeryproto.Signature) ([]step, error) {
	if sig.SubtaskType != "group" {
		s, err := w.buildStep(j, kind, index, sig, prepend, chain)
		if err != nil {
			return nil, err
		}
		return []step{s}, nil
	}
	members, err := groupMembers(sig)
	if err != nil {
		return nil, fmt.Errorf("%s step: %w", kind, err)
	}
	gid := sig.TaskID()
	if gid == "" {
		gid = stepID(j.msg.ID, kind+"/group", index)
	}
	out := make([]step, 0, len(members))
	for k, mem := range members {
		if sig.Immutable {
			mem.Immutable = true
		}
		s, err := w.buildStep(j, fmt.Sprintf("%s/%d", kind, index), k, mem, prepend, nil)
		if err != nil {
			return nil, err
		}
		if s.msg.GroupID == "" {
			s.msg.GroupID = gid
		}
		if s.msg.GroupIndex == nil {
			gi := k
			s.msg.GroupIndex = &gi
		}
		out = append(out, s)
	}
	return out, nil
}

// buildStep turns a signature into the task message Celery's
// Signature.apply_async would send from the worker: the task id and
// reply_to from the frozen options (a stable id derived from this task's id
// when the signature was not frozen, so that a repeat publishes the same
// message), parent_id = this task, root_id = this task's root.
func (w *Worker) buildStep(j *job, kind string, index int, sig celeryproto.Signature, prepend []any,
	chain []celeryproto.Signature) (step, error) {
	parent := j.msg
	o := sig.Options
	id := sig.TaskID()
	if id == "" {
		id = stepID(parent.ID, kind, index)
	}
	args := sig.Args
	if !sig.Immutable && len(prepend) > 0 {
		args = append(slices.Clip(prepend), sig.Args...)
	}
	kwargs := sig.Kwargs
	if kwargs == nil {
		kwargs = map[string]any{}
	}
	root := parent.RootID
	if root == "" {
		root = parent.ID
	}
	m := &celeryproto.Message{
		Protocol: 2, Task: sig.Task, ID: id, Args: args, Kwargs: kwargs,
		Chain: chain, RootID: root, ParentID: parent.ID,
		ReplyTo: optString(o, "reply_to"), CorrelationID: id, Origin: w.cfg.Hostname,
		GroupID: optString(o, "group_id"), Shadow: optString(o, "shadow"), Priority: parent.Priority,
		ArgsRepr: celeryproto.ArgsRepr(args), KwargsRepr: celeryproto.Repr(kwargs),
	}
	if v, ok := optNumber(o, "group_index"); ok {
		gi := int(v)
		m.GroupIndex = &gi
	}
	if v, ok := optNumber(o, "priority"); ok && v >= 0 && v <= 255 {
		m.Priority = uint8(v)
	}
	if v, ok := o["ignore_result"].(bool); ok {
		m.IgnoreResult = v
	}
	if v, ok := optNumber(o, "time_limit"); ok {
		m.TimeLimit.Hard = seconds(v)
	}
	if v, ok := optNumber(o, "soft_time_limit"); ok {
		m.TimeLimit.Soft = seconds(v)
	}
	now := time.Now()
	if v, ok := optNumber(o, "countdown"); ok {
		m.ETA = now.Add(seconds(v))
	} else if s := optString(o, "eta"); s != "" {
		t, err := celeryproto.ParseTime(s)
		if err != nil {
			return step{}, fmt.Errorf("%s step %s: eta: %w", kind, sig.Task, err)
		}
		m.ETA = t
	}
	if v, ok := optNumber(o, "expires"); ok {
		m.Expires = now.Add(seconds(v))
	} else if s := optString(o, "expires"); s != "" {
		t, err := celeryproto.ParseTime(s)
		if err != nil {
			return step{}, fmt.Errorf("%s step %s: expires: %w", kind, sig.Task, err)
		}
		m.Expires = t
	}
	if h, ok := o["headers"].(map[string]any); ok {
		m.Headers = h
	}
	var err error
	if m.Callbacks, err = optSignatures(o, "link"); err != nil {
		return step{}, fmt.Errorf("%s step %s: %w", kind, sig.Task, err)
	}
	if m.Errbacks, err = optSignatures(o, "link_error"); err != nil {
		return step{}, fmt.Errorf("%s step %s: %w", kind, sig.Task, err)
	}
	if c, ok := o["chord"].(map[string]any); ok {
		s, err := sigFrom(c)
		if err != nil {
			return step{}, fmt.Errorf("%s step %s: chord: %w", kind, sig.Task, err)
		}
		m.Chord = &s
	}
	s := step{kind: kind, msg: m}
	s.exchange, s.routingKey, s.queue = w.route(j, sig.Task, o)
	return s, nil
}

// route decides where a step goes: the signature's exchange and routing
// key, else its queue, else Config.Routes, else the queue this delivery
// came from for a task this worker serves, else Celery's default queue
// "celery". A queue is reached through the default exchange.
func (w *Worker) route(j *job, task string, o map[string]any) (exchange, routingKey, queue string) {
	if ex, rk := optString(o, "exchange"), optString(o, "routing_key"); ex != "" || rk != "" {
		if ex == "" && rk != "" {
			return "", rk, rk
		}
		return ex, rk, ""
	}
	if q := optString(o, "queue"); q != "" {
		return "", q, q
	}
	if q := w.cfg.Routes[task]; q != "" {
		return "", q, q
	}
	if q := j.d.origin().Queue; q != "" {
		if _, ok := w.reg.get(task); ok {
			return "", q, q
		}
	}
	return "", "celery", "celery"
}

// publishSteps publishes steps in order, each with a confirm. A step to a
// queue that does not exist yet (returned as unroutable) gets the queue
// declared as kombu declares it, and is published again.
func (w *Worker) publishSteps(ctx context.Context, j *job, steps []step) error {
	for _, s := range steps {
		p, err := celeryproto.EncodeTask(s.msg, celeryproto.EncodeOptions{Protocol: 2, Serializer: j.msg.Serializer()})
		if err != nil {
			return fmt.Errorf("encode %s step %s: %w", s.kind, s.msg.Task, err)
		}
		if ss, ok := w.tr.(stepSender); ok {
			q := s.queue
			if q == "" {
				q = s.routingKey
			}
			if err := ss.sendStep(ctx, q, p); err != nil {
				return fmt.Errorf("send %s step %s to SQS queue %s: %w", s.kind, clip.String(s.msg.Task, 128), clip.String(q, 128), err)
			}
			w.m.steps.WithLabelValues(kindLabel(s.kind)).Inc()
			continue
		}
		err = w.publish(ctx, s.exchange, s.routingKey, p, amqp.PublishOptions{Mandatory: true})
		if errors.Is(err, amqp.ErrReturned) && s.queue == "" {
			// Routed by an exchange that has no queue for it: Celery's
			// producer would lose it silently; waiting would hold the
			// delivery for ever.
			err = &amqp.RefusedError{Op: "publish", Exchange: clip.String(s.exchange, 128), RoutingKey: clip.String(s.routingKey, 128),
				Reason: "unroutable: no queue is bound for it", Err: err}
		}
		if errors.Is(err, amqp.ErrReturned) && s.queue != "" {
			dctx, cancel := context.WithTimeout(ctx, opTimeout)
			derr := w.pub.Declare(dctx, amqp.CeleryQueue(s.queue))
			cancel()
			if derr != nil {
				return fmt.Errorf("declare queue %s for %s step %s: %w", clip.String(s.queue, 128), s.kind, clip.String(s.msg.Task, 128), derr)
			}
			err = w.publish(ctx, s.exchange, s.routingKey, p, amqp.PublishOptions{Mandatory: true})
		}
		if err != nil {
			return fmt.Errorf("publish %s step %s: %w", s.kind, clip.String(s.msg.Task, 128), err)
		}
		w.m.steps.WithLabelValues(kindLabel(s.kind)).Inc()
		if ce := w.log.Check(zap.DebugLevel, "workflow step published"); ce != nil {
			ce.Write(w.fields(j, zap.String("step", s.kind), zap.String("step_task", s.msg.Task),
				zap.String("step_id", s.msg.ID))...)
		}
	}
	return nil
}

// followUp publishes the workflow steps of a successful operation before
// its result goes to the caller. With a record, the steps already published
// for the operation (idempotency Followups) are not published again, and
// those published now are recorded: a duplicate delivery of a completed
// chain step does not start the rest of the chain twice. Without a record
// (pure tasks) every successful run publishes its steps, as Celery does. It
// reports whether the delivery may go on to its reply; on false the
// delivery was given back or is looked at again later.
func (w *Worker) followUp(ctx context.Context, j *job, res []byte) bool {
	m := j.msg
	if len(m.Callbacks) == 0 && len(m.Chain) == 0 {
		return true
	}
	v, err := jsonValue(res)
	if err != nil {
		w.log.Error("result is not JSON; workflow steps get null", w.fields(j, zap.Error(err))...)
	}
	steps, err := w.successSteps(j, v)
	if err != nil {
		// A malformed step can never be published; the caller hears of it.
		w.log.Error("workflow step cannot be built", w.fields(j, zap.Error(err))...)
		return true
	}
	recorded := j.key != "" && w.store != nil && !w.cfg.hooks.NoRecord
	if recorded {
		done, err := w.store.Followups(ctx, j.h.name, j.key)
		if err != nil {
			w.recordTrouble(ctx, j, "read published workflow steps", err)
			return false
		}
		steps = slices.DeleteFunc(steps, func(s step) bool { return slices.Contains(done, s.msg.ID) })
		if len(steps) == 0 {
			return true
		}
	}
	if err := w.publishSteps(ctx, j, steps); err != nil {
		if amqp.IsPermanent(err) {
			// The operation is done (and recorded, when it has a record);
			// what follows it can never be published: the caller and the
			// chain hear of it and the message is quarantined, not run again.
			w.publishRefused(ctx, j, err)
			return false
		}
		w.recordTrouble(ctx, j, "publish workflow steps", err)
		return false
	}
	if recorded {
		ids := make([]string, len(steps))
		for i, s := range steps {
			ids[i] = s.msg.ID
		}
		fctx, cancel := final(ctx)
		err := w.store.AddFollowups(fctx, j.h.name, j.key, ids)
		cancel()
		if err != nil {
			// Published but not recorded: a later duplicate publishes the same
			// messages (same task ids) again.
			w.log.Warn("workflow steps published but not recorded", w.fields(j, zap.Error(err))...)
		}
	}
	return true
}

// failWorkflow carries a failure along the workflow, as Celery's
// Backend.mark_as_failure does: FAILURE with the same exception to every
// remaining chain step that has a task id (so that chain.get() raises),
// then the link_error errbacks. It reports whether the delivery may be
// acknowledged.
func (w *Worker) failWorkflow(ctx context.Context, j *job, exc *celeryproto.Exception, traceback string) bool {
	m := j.msg
	for _, sig := range m.Chain {
		targets := []celeryproto.Signature{sig}
		if sig.SubtaskType == "group" {
			// Celery stores the failure under the group's id only; its
			// members' callers (GroupResult.get) hear of it too here.
			members, _ := groupMembers(sig)
			targets = append(targets, members...)
		}
		for _, t := range targets {
			id, replyTo := t.TaskID(), t.ReplyTo()
			if id == "" || (replyTo == "" && w.backend == nil) {
				continue
			}
			r := &celeryproto.Result{TaskID: id, Status: celeryproto.StateFailure, Exception: exc, Traceback: traceback}
			if !w.publishResultTo(ctx, j, replyTo, r) {
				return false
			}
		}
	}
	if len(m.Errbacks) == 0 {
		return true
	}
	steps, err := w.errbackSteps(j)
	if err != nil {
		w.log.Error("errback cannot be built", w.fields(j, zap.Error(err))...)
		return true
	}
	if err := w.publishSteps(ctx, j, steps); err != nil {
		if amqp.IsPermanent(err) {
			// The caller has its FAILURE; the errback can never go.
			w.quarantine(ctx, j, ReasonPublishRefused, fmt.Errorf("%w (after the failure: %s)", err, clip.String(traceback, maxLogField)))
			return false
		}
		w.log.Warn("errbacks not published; delivery requeued", w.fields(j, zap.String("error", clip.String(err.Error(), maxLogField)))...)
		w.giveBack(j)
		return false
	}
	return true
}

// publishRefused answers a delivery whose workflow step, retry or re-hold
// the broker refused for what it is (amqp.IsPermanent): FAILURE
// onceler.exceptions.PublishRefused to the caller and along the chain, the
// errbacks, then the quarantine. The task is not run again.
func (w *Worker) publishRefused(ctx context.Context, j *job, err error) {
	msg := clip.String(err.Error(), maxDetail)
	w.log.Error("publish refused by the broker; caller answered FAILURE, message quarantined",
		w.fields(j, zap.String("error", clip.String(msg, maxLogField)))...)
	exc := &celeryproto.Exception{Type: "PublishRefused", Module: "onceler.exceptions", Message: msg}
	if w.wantEvents() {
		w.event(ctx, j, failedEvent("task-failed", j.h.name, exc))
	}
	if !w.replyFailure(ctx, j, exc, errors.New(msg)) || !w.failWorkflow(ctx, j, exc, msg) {
		return
	}
	w.quarantine(ctx, j, ReasonPublishRefused, err)
}

// stepID derives the task id of an unfrozen signature from the id of the
// task that publishes it: the same delivery always publishes the same id.
// It has the form of a version 4 UUID.
func stepID(parent, kind string, index int) string {
	sum := sha256.Sum256([]byte("onceler step\x00" + parent + "\x00" + kind + "\x00" + strconv.Itoa(index)))
	return uuid.Form([16]byte(sum[:16]))
}

// refuseWorkflow answers a message whose workflow cannot be carried out
// before anything runs: FAILURE NotImplementedError to the caller and along
// the chain, errbacks, then the quarantine (the message is kept).
func (w *Worker) refuseWorkflow(ctx context.Context, j *job, why string) {
	w.m.failed.WithLabelValues(j.h.name).Inc()
	w.log.Error("workflow not supported; message refused", w.fields(j, zap.String("why", why))...)
	err := errors.New("onceler: " + why)
	exc := &celeryproto.Exception{Type: "NotImplementedError", Module: "builtins", Message: err.Error()}
	if w.wantEvents() {
		w.event(ctx, j, failedEvent("task-failed", j.h.name, exc))
	}
	if !w.replyFailure(ctx, j, exc, err) || !w.failWorkflow(ctx, j, exc, err.Error()) {
		return
	}
	w.quarantine(ctx, j, ReasonUnsupported, err)
}

// kindLabel is the metric label of a step kind ("link/0" for a group
// member of link callback 0 is "link").
func kindLabel(kind string) string {
	k, _, _ := strings.Cut(kind, "/")
	return k
}
