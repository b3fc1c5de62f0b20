package tasks

// The job: what one delivery carries through the pipeline's stages
// (pipeline.go lists them), and the log fields that name it.

import (
	"time"

	"go.uber.org/zap"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/clip"
)

// job is one delivery on its way through the pipeline: each stage reads
// what the stages before it set and adds its own.
type job struct {
	d        delivery // from the worker's transport (transport.go)
	received time.Time
	// need is what decoding the delivery may take (its estimate); charge
	// is what it is charged against the memory budget now. Guarded by w.mu.
	need, charge int64
	msg          *celeryproto.Message // nil until decoded
	prepared     bool                 // decode and bind found it runnable: msg, h, args, key and fp are set
	// verdict: why the delivery goes to quarantine, once decided; a
	// quarantine whose publish failed is tried again from it, not from
	// decode and bind (which would answer the caller again).
	verdict *verdict
	h       *handler
	args    any
	key     string
	fp      []byte
	checks  int  // deferrals so far
	waiting bool // deferred because the operation was in progress elsewhere
	runtime time.Duration
	attempt int // the record's attempt of the claim this delivery runs under
	// claimToken: the token of a claim whose outcome is not known yet (see
	// outsideRun.claim); empty once it is.
	claimToken idempotency.Token
	// redeliveries: the operation's redeliveries counted when this
	// redelivered same-database message arrived (0: not counted).
	redeliveries int
	// rehold: held for its ETA longer than Config.MaxHold allows; when the
	// hold ends before the ETA, the delivery is republished and acknowledged.
	rehold bool
	// evicted: held for its ETA, it is on its way back to its queue to make
	// room in the memory budget for a delivery waiting for it (evictHeld).
	evicted bool
	// abandoned: the task did not return by its hard time limit and runs on
	// unwatched; its outcome is unknown.
	abandoned bool
	// completed: the record holds this run's success as completed (its
	// result is what finish is given), so a redelivery is answered from
	// it (lostWhileRunning).
	completed bool
	// named, keyed: an event of this delivery carried the task name, the
	// operation key's hash (later events leave them out: an event reader
	// merges a task's events).
	named, keyed bool
	// rated: its task's rate limit let it start (or it waited for it).
	rated bool
	// rateBucket, rateAt: the bucket whose start at rateAt it waits for
	// (nil once it started or gave the start back), guarded by
	// taskTuning.mu; rateRehold: its wait was cut to Config.MaxHold, and it
	// is republished when that is over.
	rateBucket *bucket
	rateAt     time.Time
	rateRehold bool
	// limits: the task's time limits as they stood when it was let run
	// (its registration's, or those set at run time by time_limit).
	limits timeLimits
}

// verdict is a decision to quarantine a delivery.
type verdict struct {
	reason string
	cause  error
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
