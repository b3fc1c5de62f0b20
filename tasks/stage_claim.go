package tasks

// Stage 4, claim. Receives a job due now. An outside task's delivery claims
// its operation here (outsideRun.claim) and, on a first claim, hands the
// outsideRun on to the run stage. Every other outcome of a claim, and the
// outcome of a same-database run's claim (stage_run.go), is answered here
// (answerClaim): completed → the stored result (duplicate,
// stage_answer.go); in progress elsewhere → deferred (held.go); stale → the
// task's stale-claim policy; held, skipped, fingerprint mismatch → FAILURE.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/idempotency"
)

// outsideRun is one delivery's run of an outside task, from its claim to its
// settled record: the claim stage fills it (claim), the run stage runs the
// task under its lease (run, stage_run.go) and the settle stage records the
// outcome (settle, stage_settle.go).
type outsideRun struct {
	w *Worker
	j *job
	p idempotency.ClaimParams
	// ref is the claim the delivery owns once claim returns true; since is
	// when its lease was taken or last renewed.
	ref   idempotency.Ref
	since time.Time
}

// claim claims the operation (a stale claim goes to the task's policy) and
// renews a lease that a takeover or a slow claim has shortened. It reports
// whether the delivery owns a first claim to run the task under; otherwise
// the delivery has been answered, deferred or given back.
func (o *outsideRun) claim(ctx context.Context) bool {
	w, j := o.w, o.j
	if j.waiting && !o.recheck(ctx) {
		return false
	}
	p := w.claimParams(j)
	if j.claimToken == "" {
		j.claimToken = idempotency.NewToken()
	}
	// Until the claim's outcome is known, every claim of this delivery takes
	// the same token: a claim (or takeover) that committed while its answer
	// was lost is then found to be this delivery's own, not in progress.
	p.Token = j.claimToken
	o.p = p
	start := time.Now()
	claim, err := w.store.Claim(ctx, p)
	w.m.claimSecs.Observe(time.Since(start).Seconds())
	if err != nil {
		w.recordTrouble(ctx, j, "claim", err)
		return false
	}
	tookOver := false
	if claim.Outcome == idempotency.OutcomeStale {
		tookOver = true
		claim, err = o.applyPolicy(ctx, claim)
		if err != nil {
			// The policy may have taken the claim over with this delivery's
			// token and failed after (the completion after a lookup, a
			// fallback hold): a claim with that token would be this
			// delivery's own and run the task, whatever the policy decided.
			// The next claim takes a new token and finds the record as the
			// policy left it (once its lease lapses, stale again: the policy
			// decides again).
			j.claimToken = ""
			w.recordTrouble(ctx, j, "stale policy", err)
			return false
		}
	}
	j.claimToken = ""
	if claim.Outcome != idempotency.OutcomeFirst {
		w.answerClaim(ctx, j, claim)
		return false
	}
	if crashes := claim.Attempt - j.msg.Retries; j.d.redelivered() && crashes > w.cfg.MaxAttempts {
		// A redelivered message whose operation was claimed this often keeps
		// killing its workers: stop the loop. Each Celery retry claims the
		// operation once more: those claims are not counted.
		ref := p.Ref(claim.Token)
		perr := fmt.Errorf("operation claimed %d times besides %d retries (limit %d)", crashes, j.msg.Retries, w.cfg.MaxAttempts)
		fctx, cancel := final(ctx)
		err := w.store.Fail(fctx, ref, "quarantined as poison: "+perr.Error())
		cancel()
		if err != nil {
			w.recordTrouble(ctx, j, "fail", err)
			return false
		}
		w.quarantinePoison(ctx, j, perr)
		return false
	}
	j.attempt = claim.Attempt
	o.ref = p.Ref(claim.Token)
	o.since = claim.Since
	if tookOver || time.Since(o.since) > p.Lease/3 {
		// A takeover (its lookup took some of the lease) or a slow claim:
		// the database must say the lease still holds before the task
		// starts, and the renewal starts it afresh.
		renewed := time.Now()
		if err := w.store.Renew(ctx, o.ref, p.Lease); err != nil {
			// The task has not run: the next claim takes this claim's token
			// again, so that it finds the claim its own (first, the lease
			// renewed) unless another delivery took it over meanwhile;
			// with a new token it would find its own claim stale and hand an
			// operation that never ran to the stale-claim policy.
			j.claimToken = claim.Token
			if errors.Is(err, idempotency.ErrFenced) {
				w.log.Warn("claim lapsed before the task started; not run yet", w.fields(j)...)
				w.deferDelivery(j, time.Time{})
				return false
			}
			w.recordTrouble(ctx, j, "renew before run", err)
			return false
		}
		o.since = renewed
	}
	return true
}

// applyPolicy settles a stale claim by the task's policy.
func (o *outsideRun) applyPolicy(ctx context.Context, stale idempotency.Claim) (idempotency.Claim, error) {
	w, j, p := o.w, o.j, o.p
	h := j.h
	w.log.Warn("stale claim: applying policy", w.fields(j, zap.String("policy", h.policy.String()),
		zap.String("stale_owner", stale.Owner), zap.String("stale_task_id", stale.TaskID))...)
	w.m.stale.WithLabelValues(h.name, h.policy.String()).Inc()
	sp := idempotency.StalePolicy{Policy: h.policy, Fallback: h.fallback, LookupTimeout: h.lookupTimeout}
	if h.policy == PolicyHold || h.fallback == PolicyHold {
		p.Message = w.heldCopy(j)
	}
	if h.lookup != nil {
		sp.Lookup = func(ctx context.Context, key string) ([]byte, bool, error) {
			c := w.call(j, stale.Attempt+1)
			v, found, err := h.lookup(ctx, c, j.args)
			if err != nil || !found {
				return nil, found, err
			}
			b, err := encodeResult(v)
			return b, err == nil, err
		}
	}
	return w.store.ApplyPolicy(ctx, p, stale, sp)
}

func (w *Worker) claimParams(j *job) idempotency.ClaimParams {
	lease := j.h.lease
	if lease <= 0 {
		lease = w.cfg.Lease
	}
	return idempotency.ClaimParams{Task: j.h.name, Key: j.key, Fingerprint: j.fp, Owner: w.cfg.Hostname,
		TaskID: j.msg.ID, Lease: lease, AllowMismatch: j.h.allowMismatch}
}

// answerClaim acts on a claim outcome other than a run of our own, or on
// the completed claim of a same-database run in this delivery.
func (w *Worker) answerClaim(ctx context.Context, j *job, claim idempotency.Claim) {
	switch claim.Outcome {
	case idempotency.OutcomeFirst:
		// same-database: ran and committed here. The result as the record
		// keeps it, so that this caller and a duplicate's get the same.
		j.completed = true
		w.finish(ctx, j, claim.Result, nil)
	case idempotency.OutcomeCompleted:
		w.duplicate(ctx, j, claim.Result)
	case idempotency.OutcomeStale:
		// Only a same-database task whose own statement committed the
		// claim without its completion leaves one (an outside task's goes
		// to its policy before this): its effect may have committed with
		// it, and a person decides.
		w.holdSameDB(ctx, j, claim)
	case idempotency.OutcomeInProgress:
		w.deferDelivery(j, claim.LeaseUntil)
	case idempotency.OutcomeMismatch:
		w.log.Warn("fingerprint mismatch: same operation key, different arguments", w.fields(j)...)
		err := fmt.Errorf("operation %s of task %s was recorded with different arguments", j.key, j.h.name)
		exc := &celeryproto.Exception{Type: "ValueError", Module: "builtins", Message: "idempotency: " + err.Error()}
		if w.replyFailure(ctx, j, exc, err) {
			w.quarantine(ctx, j, ReasonMismatch, err)
		}
	case idempotency.OutcomeHeld:
		w.m.held.WithLabelValues(j.h.name).Inc()
		w.log.Warn("operation is held for a person to resolve; caller answered OperationHeld, its message is kept in the record",
			w.fields(j)...)
		// The caller would otherwise wait for a result that comes only if a
		// person resolves the operation: it gets a FAILURE saying so.
		exc := &celeryproto.Exception{Type: "OperationHeld", Module: "onceler.exceptions",
			Message: "operation held after a stale claim: its effect may or may not have happened; resolve it with '" + w.cfg.Program + " resolve'"}
		if w.replyFailure(ctx, j, exc, errors.New(exc.Message)) {
			w.ack(j)
		}
	case idempotency.OutcomeSkipped:
		w.log.Warn("operation was skipped by its stale-claim policy", w.fields(j)...)
		exc := &celeryproto.Exception{Type: "OperationSkipped", Module: "onceler.exceptions",
			Message: "operation skipped after a stale claim (policy skip)"}
		if w.replyFailure(ctx, j, exc, errors.New(exc.Message)) {
			w.ack(j)
		}
	default:
		w.recordTrouble(ctx, j, "claim", fmt.Errorf("unexpected claim outcome %v", claim.Outcome))
	}
}

// holdSameDB holds the stale claim of a same-database operation and
// answers the delivery as held.
func (w *Worker) holdSameDB(ctx context.Context, j *job, stale idempotency.Claim) {
	p := w.claimParams(j)
	p.Message = w.heldCopy(j)
	w.m.stale.WithLabelValues(j.h.name, PolicyHold.String()).Inc()
	w.log.Warn("same-database claim committed without its completion: held", w.fields(j)...)
	c, err := w.store.ApplyPolicy(ctx, p, stale, idempotency.StalePolicy{Policy: PolicyHold,
		Reason: "same-database claim committed without its completion (the task ended its transaction)"})
	if err != nil {
		w.recordTrouble(ctx, j, "hold", err)
		return
	}
	if c.Outcome == idempotency.OutcomeStale {
		w.deferDelivery(j, c.LeaseUntil)
		return
	}
	w.answerClaim(ctx, j, c)
}
