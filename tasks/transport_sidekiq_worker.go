package tasks

// The Sidekiq transport as a Worker runs it (Config.Sidekiq): its client
// (package sidekiq) is opened by prepare, which also starts the client's
// Run (heartbeat, scheduler, recovery of dead processes' jobs, the
// "<identity>-signals" list); each run of a job is shown in the process's
// work hash (Begin, End); a TERM through the signals list stops the worker
// as its context would (TSTP only makes the process quiet: Fetch hands out
// nothing more); close hands the jobs still in the working lists back to
// their queues (RequeueAll), then stops Run and closes the client.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/pause"
	"github.com/onceler/onceler/sidekiq"
)

// sidekiqWorkerTransport is the Sidekiq transport of a Worker.
type sidekiqWorkerTransport struct {
	*sidekiqTransport[*sidekiq.Job]
	cfg    sidekiq.Config
	log    *zap.Logger
	onTerm func()

	client    *sidekiq.Client
	runCancel context.CancelFunc
	runDone   chan struct{}
}

func newSidekiqWorkerTransport(cfg *Config, log *zap.Logger, onTerm func()) *sidekiqWorkerTransport {
	scfg := *cfg.Sidekiq
	if scfg.Concurrency <= 0 {
		scfg.Concurrency = cfg.Concurrency
	}
	if scfg.Logger == nil {
		scfg.Logger = log
	}
	t := &sidekiqWorkerTransport{cfg: scfg, log: log, onTerm: onTerm}
	t.sidekiqTransport = newSidekiqTransport[*sidekiq.Job](nil, sidekiqView, sidekiq.ErrNotHeld, cfg.Prefetch)
	t.sidekiqTransport.log = log
	return t
}

// sidekiqView is what the transport reads of a job of package sidekiq.
func sidekiqView(j *sidekiq.Job) sidekiqJob {
	return sidekiqJob{Queue: j.Queue, Class: j.Class, JID: j.JID, IdempotencyKey: j.IdempotencyKey, Raw: j.Raw,
		Args: j.Args, RetryCount: j.RetryCount}
}

// prepare opens the client (its first heartbeat) and starts its Run.
func (t *sidekiqWorkerTransport) prepare(context.Context) error {
	c, err := sidekiq.New(t.cfg)
	if err != nil {
		return fmt.Errorf("tasks: %w", err)
	}
	t.client = c
	t.sidekiqTransport.client = c
	t.begin = c.Begin
	t.end = c.End
	t.count = c.CountDelivery
	t.forget = c.ForgetDeliveries
	t.uncount = c.UncountDeliveries
	ctx, cancel := context.WithCancel(context.Background())
	t.runCancel, t.runDone = cancel, make(chan struct{})
	go func() {
		defer close(t.runDone)
		if err := c.Run(ctx, t.signal); err != nil {
			t.log.Error("sidekiq heartbeat stopped", zap.Error(err))
		}
	}()
	t.log.Info("consuming Sidekiq jobs", zap.String("redis", sidekiq.RedactURL(t.cfg.URL)),
		zap.Strings("queues", t.cfg.Queues), zap.String("identity", c.Identity()))
	return nil
}

// signal is the client's callback for a signal sent through Sidekiq's API.
func (t *sidekiqWorkerTransport) signal(sig string) {
	switch sig {
	case "TSTP":
		t.log.Info("sidekiq TSTP: quiet, no more jobs fetched")
	case "TERM":
		t.log.Info("sidekiq TERM: stopping gracefully")
		t.onTerm()
	}
}

// close ends the retries of give-backs under way, hands back the jobs
// left in the working lists (those whose runs did not begin taken off
// their delivery counts first: uncountUnstarted), then stops the heartbeat
// (the process leaves Sidekiq's process set) and closes the client.
func (t *sidekiqWorkerTransport) close() error {
	if t.client == nil {
		return nil
	}
	t.stopBacks()
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	var errs []error
	if err := t.uncountUnstarted(ctx); err != nil {
		t.log.Warn("taking the Sidekiq jobs handed back unrun off their delivery counts failed; their counts stay one too high", zap.Error(err))
	}
	if _, err := t.client.RequeueAll(ctx); err != nil {
		errs = append(errs, err)
		t.log.Error("unfinished Sidekiq jobs not handed back: they come back when this process is taken for dead", zap.Error(err))
	}
	t.runCancel()
	<-t.runDone
	errs = append(errs, t.client.Close())
	return errors.Join(errs...)
}

// sidekiqErrorClass is the error class of a job the worker sends to the
// dead set without running it, by the quarantine reason (Header* values):
// "Onceler::" and the reason in Ruby's spelling (unknown_task:
// Onceler::UnknownTask); an undecodable job's is Onceler::UndecodableJob.
func sidekiqErrorClass(reason string) string {
	if reason == ReasonUndecodable {
		return "Onceler::UndecodableJob"
	}
	var b strings.Builder
	b.WriteString("Onceler::")
	for _, part := range strings.Split(reason, "_") {
		if part != "" {
			b.WriteString(strings.ToUpper(part[:1]) + part[1:])
		}
	}
	return b.String()
}

// runMarker is a delivery that shows its runs to its broker's tools (the
// Sidekiq transport: the process's work hash and counts).
type runMarker interface {
	runStarted()
	runEnded(failed bool)
}

// failingDelivery is a delivery whose transport has its own answer to a
// task's failure (Sidekiq: the retry set with its backoff, then the dead
// set), instead of the ack a Celery message gets once the caller is told.
type failingDelivery interface {
	delivery
	// failed moves the delivery on after a failed run of its task,
	// settling it.
	failed(ctx context.Context, class, message string, backtrace []string) error
}

// settleFailed settles a delivery whose task failed (finish, stage_answer.go)
// through its transport's own answer: tried again while the broker does
// not answer and the worker runs; then given back (it comes again).
func (w *Worker) settleFailed(ctx context.Context, j *job, d failingDelivery, class, message string, backtrace []string) {
	for attempt := 0; ; attempt++ {
		fctx, cancel := final(ctx)
		err := d.failed(fctx, class, message, backtrace)
		cancel()
		if err == nil {
			if out, ok := w.retryOutcome(j); ok {
				w.log.Info("failed job handed to Sidekiq's retry", w.fields(j, zap.Stringer("outcome", out))...)
			}
			w.forget(j)
			return
		}
		if d.stale() {
			w.log.Info("failed job taken back by its broker before it was settled; it comes again", w.fields(j, zap.Error(err))...)
			w.forget(j)
			return
		}
		w.log.Warn("settling a failed job failed; retrying", w.fields(j, zap.Error(err))...)
		if ctx.Err() != nil || attempt >= 20 || !pause.For(ctx, min(50*time.Millisecond<<min(attempt, 5), 2*time.Second)) {
			w.giveBack(j)
			return
		}
	}
}

// retryOutcomer is a delivery that tells where its transport's retry sent
// it (the Sidekiq transport).
type retryOutcomer interface {
	retryOutcome() sidekiq.RetryOutcome
}

// retryOutcome is where the retry of j's delivery sent it (ok false: its
// transport does not tell), counted in the metrics by outcome.
func (w *Worker) retryOutcome(j *job) (sidekiq.RetryOutcome, bool) {
	ro, ok := j.d.(retryOutcomer)
	if !ok {
		return 0, false
	}
	out := ro.retryOutcome()
	w.m.skRetries.WithLabelValues(j.h.name, out.String()).Inc()
	return out, true
}

// sidekiqClassOf is the error_class a failed run gives its Sidekiq job:
// the exception's type as the task's error reads (PythonError's Type,
// TimeLimitExceeded, Exception for a plain error).
func sidekiqClassOf(exc *celeryproto.Exception) string { return exc.Type }
