package tasks

// The pipeline: the path of one delivery, from the arrival goroutine that
// takes it (stage_arrive.go) and the task goroutine that runs it
// (Worker.loop, worker.go) to its ack. Its stages, in order, each in a file
// of its own; each receives the job from the one before and hands it on.
//
// The job's delivery comes from the worker's transport and is read, moved
// and settled only through the delivery interface (transport.go), whatever
// the transport; the worker's transport is RabbitMQ's (transport_amqp.go), or
// Sidekiq's with Config.Sidekiq (transport_sidekiq_worker.go). The
// answer to the caller and the workflow's next steps go where the message
// says (its reply_to, the result backend, its links), not by its delivery.
//
// Stages 1 to 3 run on arrival, before a task slot is free; a job coming
// back (deferred, or due after its ETA) runs process again from stage 3:
//
//  1. decode (stage_decode.go): the Celery message out of the delivery's
//     wire form, charged against the memory budget; the transport's
//     delivery count.
//  2. bind (stage_bind.go): the registered task, its arguments (bound by
//     bind.go), the operation key and the argument fingerprint.
//  3. due (stage_due.go): a revoked or expired message is answered; one
//     whose ETA is ahead is held unacknowledged until it is due.
//  4. claim (stage_claim.go): the idempotency claim and what each of its
//     outcomes means; a delivery whose operation another run holds waits
//     unacknowledged (held.go).
//  5. run (stage_run.go): the task function under its time limits, panics
//     recovered, a retry request handed on as the task's outcome.
//  6. settle (stage_settle.go): the record completed, failed, released or
//     held, with the claim's token.
//  7. answer (stage_answer.go): the task events, the workflow's next steps
//     and the result to the caller (rpc:// or the result backend).
//  8. ack (stage_ack.go): the delivery acknowledged, or given back to its
//     transport.
//
// A pure task has no claim and no record; a same-database task claims, runs
// and completes in one transaction (runSameDB, stage_run.go). A stage that
// cannot hand the job on answers the delivery itself: a quarantine
// (quarantine.go), a deferral, or the record trouble and refusal paths below.
// A deferral or a hold keeps the delivery unsettled; a delivery its
// transport took back meanwhile (stale: its AMQP channel is gone) is
// dropped, as the transport delivers it again.

import (
	"context"
	"time"

	"go.uber.org/zap"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/clip"
)

// process takes one delivery through the pipeline's stages. Every path ends
// in exactly one of: ack (after the outcome is recorded and answered), a
// deferral (the delivery stays unacknowledged and is looked at again later),
// or no answer at all (the delivery is stale or given back: its transport
// delivers it again).
func (w *Worker) process(ctx context.Context, j *job) {
	if j.d.stale() {
		// Its transport has it back (its channel is gone) and delivers it
		// again.
		w.rateGiveBack(j)
		w.forget(j)
		return
	}
	if j.verdict != nil {
		w.quarantine(ctx, j, j.verdict.reason, j.verdict.cause)
		return
	}
	if !j.prepared {
		if !w.decode(ctx, j) || !w.bind(ctx, j) {
			return
		}
		j.prepared = true
	}
	if !w.due(ctx, j) {
		return
	}
	if w.rateLimited(ctx, j) {
		return
	}
	j.limits = w.limitsOf(j.h)
	// Claim and run, by the task's mode.
	switch {
	case j.h.mode == ModeSameDB && w.cfg.hooks.NoRecord:
		w.runOwnTx(ctx, j)
	case j.h.mode == ModePure || w.cfg.hooks.NoRecord:
		w.runPure(ctx, j)
	case j.h.mode == ModeSameDB:
		w.runSameDB(ctx, j)
	default:
		w.runOutside(ctx, j)
	}
}

// runOutside takes a delivery of an outside task through the claim, the run
// under a lease heartbeat and the settlement of the record; the settle stage
// hands it to the answer stage.
func (w *Worker) runOutside(ctx context.Context, j *job) {
	o := &outsideRun{w: w, j: j}
	if !o.claim(ctx) {
		return // answered, deferred or given back by the claim stage
	}
	res, taskErr, leaseLost := o.run(ctx)
	o.settle(ctx, res, taskErr, leaseLost)
}

// recordTrouble handles a record error: the outcome is unknown or the
// database is away, so the delivery is not acknowledged; it is looked at
// again after a pause. A definite refusal (idempotency.IsDefinite: the
// message's content is what the database refuses) is not tried again: the
// caller is answered and the delivery quarantined.
func (w *Worker) recordTrouble(ctx context.Context, j *job, what string, err error) {
	if idempotency.IsDefinite(err) {
		w.refuse(ctx, j, what, err)
		return
	}
	if ctx.Err() != nil {
		w.giveBack(j)
		return
	}
	if schemaMissing(err) {
		w.warnStall(stallSchema, "record schema missing: run '"+w.cfg.Program+" migrate'; delivery kept and retried later", j, zap.String("step", what), zap.String("error", clip.String(err.Error(), maxLogField)))
	} else {
		w.warnStall(stallRecord, "record unavailable; delivery kept and retried later", j, zap.String("step", what), zap.String("error", clip.String(err.Error(), maxLogField)))
	}
	j.checks++
	w.later(j, min(100*time.Millisecond<<min(j.checks, 5), 2*time.Second))
}

// refuse answers a delivery whose record write the database refused for
// its content (a definite error, before any effect ran: a claim) with
// FAILURE onceler.exceptions.RecordRefused, and quarantines it.
func (w *Worker) refuse(ctx context.Context, j *job, what string, err error) {
	w.log.Error("the record refused this message's operation; quarantined", w.fields(j, zap.String("step", what), zap.Error(err))...)
	exc := &celeryproto.Exception{Type: "RecordRefused", Module: "onceler.exceptions",
		Message: "the idempotency record refused the operation: " + err.Error()}
	if w.replyFailure(ctx, j, exc, err) {
		w.quarantine(ctx, j, ReasonRefused, err)
	}
}
