package tasks

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/control"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/clip"
	"github.com/onceler/onceler/internal/shellquote"
)

// Worker consumes Celery task messages and runs the registered tasks, each
// operation's effect once. Create it with NewWorker and start it with Run.
type Worker struct {
	reg      *Registry
	cfg      Config
	log      *zap.Logger
	store    *idempotency.Store
	ownStore bool
	// tr brings the deliveries (transport.go); pub publishes to the
	// Celery broker: results (rpc://) and workflow steps.
	tr      transport
	pub     *amqp.Publisher
	dec     *memDecoder
	backend resultBackend // nil: rpc://
	m       *metrics
	// tm: each task's children of the per-task metrics (taskMetricsOf).
	tm      atomic.Pointer[map[*handler]*taskMetrics]
	tmMu    sync.Mutex
	started time.Time // guarded by mu: Stats reads it

	// kill ends the process at a crash point (SIGKILL; replaced in tests).
	kill    func()
	crashed atomic.Bool
	// ctl is the worker's remote control (nil with Config.NoControl); its
	// shutdown command calls stopRun, the cancel function of Run's context.
	ctl     *control.Controller
	stopRun atomic.Pointer[context.CancelFunc]
	// obs gets the task events: Config.Observer, the remote control, or
	// both (nil: none).
	obs Observer
	// taskEvents reports whether obs wants task events now (its TaskEvents
	// method); nil: it always does.
	taskEvents func() bool
	// taskObs is obs when it takes task events as values.
	taskObs TaskEventObserver

	jobs     chan *job     // deliveries waiting for a task goroutine
	arrivals chan *job     // fresh deliveries waiting for an arrival goroutine (stage_arrive.go)
	quit     chan struct{} // closed when shutdown begins: take no new jobs

	// slots bounds the tasks running at once; tuning holds the rate and
	// time limits set at run time (control_cmds.go).
	slots  slotGate
	tuning taskTuning

	// busy counts the task goroutines inside the pipeline; settled is when
	// a delivery was last settled (acknowledged, given back or lost with
	// its channel), in Unix nanoseconds: readiness (stalled).
	busy       atomic.Int32
	settled    atomic.Int64
	stalledNow atomic.Bool
	stalls     stallWarn // warnings about deliveries held without progress

	ran       atomic.Bool // Run was called
	running   atomic.Bool // Run is running
	draining  atomic.Bool
	workCause context.CancelCauseFunc // cancels task contexts after the grace period
	tasks     sync.WaitGroup          // task goroutines of time-limited runs, abandoned ones included

	mu        sync.Mutex
	stopping  bool                 // no more timers or queueing
	timers    map[*job]*time.Timer // deferred and scheduled deliveries
	scheduled int                  // deliveries held until their ETA: len(held)
	held      map[*job]struct{}    // deliveries held until their ETA
	qosMu     sync.Mutex           // serializes prefetch changes
	active    map[*job]*runState   // tasks running now
	reserved  map[*job]struct{}    // received, not yet running
	revoked   revokedSet
	totals    map[string]int64 // tasks run, by name (Stats)

	// The memory budget (memory.go): the deliveries charged, by their
	// celeryproto.Delivery (what the decoder sees), the sum of their
	// charges, and the deliveries waiting for room, in order of arrival.
	charged  map[*celeryproto.Delivery]*job
	memUsed  int64
	waiting  []*job
	largest  int64         // the largest body seen lately (decays)
	gcMu     sync.Mutex    // serializes makeRoom's collections
	flowKick chan struct{} // wakes the flow goroutine (window limit)
}

type runState struct {
	started time.Time
	cancel  context.CancelCauseFunc
}

// NewWorker validates cfg and prepares a worker for the tasks of reg. It opens
// no connection; Run does.
func NewWorker(reg *Registry, cfg Config) (*Worker, error) {
	if reg == nil {
		return nil, errors.New("tasks: nil registry")
	}
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	w := &Worker{
		reg:      reg,
		cfg:      cfg,
		log:      cfg.Logger.With(zap.String("node", cfg.Hostname)),
		kill:     func() { _ = syscall.Kill(os.Getpid(), syscall.SIGKILL) },
		timers:   make(map[*job]*time.Timer),
		held:     make(map[*job]struct{}),
		active:   make(map[*job]*runState),
		reserved: make(map[*job]struct{}),
		revoked:  newRevokedSet(50000, cfg.RevokedExpiry),
		totals:   make(map[string]int64),
		charged:  make(map[*celeryproto.Delivery]*job),
		flowKick: make(chan struct{}, 1),
	}
	w.dec = &memDecoder{w: w, dec: celeryproto.NewDecoder(decoderLimits(cfg.MemoryBudget))}
	needRecord, sameDB := false, false
	for _, n := range reg.Names() {
		h, _ := reg.get(n)
		needRecord = needRecord || h.mode != ModePure
		sameDB = sameDB || h.mode == ModeSameDB
	}
	if sameDB && cfg.hooks.NoRecord && cfg.Pool == nil {
		return nil, errors.New("tasks: same-database tasks need Config.Pool (without the record they run in a transaction of their own)")
	}
	w.obs = cfg.Observer
	if !cfg.NoControl {
		if err := w.newControl(); err != nil {
			return nil, err
		}
		w.obs = withControl(cfg.Observer, w.ctl)
	}
	if te, ok := w.obs.(interface{ TaskEvents() bool }); ok {
		w.taskEvents = te.TaskEvents
	}
	if to, ok := w.obs.(TaskEventObserver); ok {
		w.taskObs = to
	}
	if needRecord && !cfg.hooks.NoRecord {
		w.store = cfg.Store
		if w.store == nil {
			if cfg.Pool == nil {
				return nil, errors.New("tasks: tasks with a record need Config.Store or Config.Pool")
			}
			s, err := idempotency.New(cfg.Pool, idempotency.Config{Logger: cfg.Logger})
			if err != nil {
				return nil, fmt.Errorf("tasks: open record: %w", err)
			}
			w.store, w.ownStore = s, true
		}
	}
	var lapsed func(context.Context) (int64, error)
	if w.store != nil {
		lapsed = w.store.StaleClaims
	}
	m, err := newMetrics(cfg.Metrics, lapsed)
	if err != nil {
		w.closeStore()
		return nil, err
	}
	w.m = m
	m.memBudget.Set(float64(cfg.MemoryBudget))
	if w.backend, err = newBackend(&w.cfg); err != nil {
		w.closeStore()
		return nil, err
	}
	// The publisher connects at its first publish: with Sidekiq, only for
	// what a job cannot ask for (a reply queue, workflow steps).
	w.pub = amqp.NewPublisher(cfg.Broker)
	switch {
	case cfg.Sidekiq != nil:
		t := newSidekiqWorkerTransport(&w.cfg, w.log, w.stop)
		t.failed = m.recvFails.Inc
		w.tr = t
	case cfg.SQS != nil:
		t := newSQSTransport(&w.cfg, w.log)
		t.failed = m.recvFails.Inc
		w.tr = t
	default:
		w.tr = newAMQPTransport(&w.cfg, w.pub)
	}
	return w, nil
}

// stop ends Run as the cancellation of its context does (a shutdown
// command, a Sidekiq TERM).
func (w *Worker) stop() {
	if p := w.stopRun.Load(); p != nil {
		(*p)()
	}
}

// Controller returns the worker's remote control: nil with
// Config.NoControl.
func (w *Worker) Controller() *control.Controller { return w.ctl }

func (w *Worker) closeStore() {
	if w.ownStore && w.store != nil {
		w.store.Close()
	}
}

// Run consumes and runs tasks until ctx is cancelled, then shuts down
// gracefully: it stops taking deliveries, lets running tasks finish within
// Config.Grace, then cancels their contexts and waits for them. Deliveries
// not finished stay unacknowledged and return to the queue. Run returns nil
// after a shutdown caused by ctx, or the error that stopped consuming. A
// Worker runs once.
func (w *Worker) Run(ctx context.Context) error {
	if !w.ran.CompareAndSwap(false, true) {
		return errors.New("tasks: worker already ran")
	}
	ctx, stop := context.WithCancel(ctx) // also the remote shutdown command
	defer stop()
	w.stopRun.Store(&stop)
	w.running.Store(true)
	defer w.running.Store(false)
	defer w.closeStore()
	defer func() { _ = w.tr.close() }()
	defer w.closeBackend()
	if err := w.checkSchema(ctx); err != nil {
		return err
	}
	w.checkBackend(ctx)
	w.mu.Lock() // Stats reads it from remote-control goroutines
	w.started = time.Now()
	w.mu.Unlock()
	w.settled.Store(time.Now().UnixNano())

	if err := w.tr.prepare(ctx); err != nil {
		return err
	}
	if w.ctl != nil {
		// The remote control reconnects on any failure: a permission it
		// lacks is found here, at start, instead.
		if err := w.ctl.CheckAccess(ctx); errors.Is(err, amqp.ErrAccessRefused) {
			return fmt.Errorf("tasks: remote control: %w", err)
		} else if err != nil {
			w.log.Warn("remote control: broker check failed; the remote control retries", zap.Error(err))
		}
	}
	// Stopped when Run returns: worker-offline goes once the tasks are done.
	defer w.runControl(ctx)()

	w.mu.Lock() // admit reads w.arrivals under w.mu
	w.jobs = make(chan *job, 1<<16)
	w.arrivals = make(chan *job, 1<<16)
	w.mu.Unlock()
	w.quit = make(chan struct{})
	workCtx, workCancel := context.WithCancelCause(context.WithoutCancel(ctx))
	defer workCancel(nil)
	w.workCause = workCancel

	var arrivals sync.WaitGroup
	for range w.arrivers() {
		arrivals.Add(1)
		go func() {
			defer arrivals.Done()
			w.arriveLoop(workCtx)
		}()
	}

	var pool sync.WaitGroup
	w.slots.start(w.cfg.Concurrency, func() {
		pool.Add(1)
		go func() {
			defer pool.Done()
			w.loop(workCtx)
		}()
	})

	consCtx, consCancel := context.WithCancel(context.WithoutCancel(ctx))
	defer consCancel()
	consDone := make(chan error, 1)
	go func() { consDone <- w.tr.consume(consCtx, w.receive) }()
	var watch sync.WaitGroup
	watch.Add(2)
	go func() {
		defer watch.Done()
		w.watchReconnects(consCtx)
	}()
	go func() {
		defer watch.Done()
		w.flow(consCtx)
	}()
	defer watch.Wait()

	w.log.Info("worker started", zap.Int("concurrency", w.cfg.Concurrency), zap.Int("prefetch", w.cfg.Prefetch),
		zap.Int64("memory_budget", w.cfg.MemoryBudget), zap.Duration("stall_after", w.cfg.StallAfter),
		zap.Strings("tasks", w.reg.Names()), zap.Bool("no_record", w.cfg.hooks.NoRecord))
	if w.cfg.hooks.NoRecord {
		w.log.Warn("running WITHOUT the idempotency record: duplicate deliveries repeat their effects")
	}

	var runErr error
	select {
	case <-ctx.Done():
	case err := <-consDone:
		consDone <- err
		runErr = fmt.Errorf("tasks: consumer stopped: %w", err)
	}

	// Graceful shutdown: the consumer cancels its subscriptions and keeps
	// its channel open for the acks of running tasks; waiting deliveries go
	// back to the queue; running tasks get the grace period.
	w.draining.Store(true)
	close(w.quit)
	w.slots.stop()
	consCancel()
	w.mu.Lock()
	w.stopping = true
	for j, t := range w.timers {
		t.Stop()
		delete(w.timers, j)
		w.requeue(j)
	}
	for len(w.waiting) > 0 {
		w.requeue(w.waiting[0]) // removes it from w.waiting
	}
	w.mu.Unlock()
	w.log.Info("worker stopping: waiting for running tasks", zap.Duration("grace", w.cfg.Grace))
	poolDone := make(chan struct{})
	go func() { pool.Wait(); arrivals.Wait(); close(poolDone) }()
	grace := time.NewTimer(w.cfg.Grace)
	select {
	case <-poolDone:
		grace.Stop()
	case <-grace.C:
		w.log.Warn("grace period over: cancelling running tasks")
		workCancel(ErrShutdown)
		<-poolDone
	}
	for {
		select {
		case j := <-w.jobs:
			w.mu.Lock()
			w.requeue(j)
			w.mu.Unlock()
			continue
		case j := <-w.arrivals:
			w.mu.Lock()
			w.requeue(j)
			w.mu.Unlock()
			continue
		default:
		}
		break
	}
	w.waitAbandoned()
	if err := <-consDone; err != nil && runErr == nil {
		runErr = fmt.Errorf("tasks: consumer: %w", err)
	}
	w.log.Info("worker stopped")
	return runErr
}

// waitAbandoned waits for the goroutines of tasks abandoned at their hard
// time limit (their contexts are cancelled), at most Config.Grace: Go cannot
// stop a goroutine that ignores its context.
func (w *Worker) waitAbandoned() {
	done := make(chan struct{})
	go func() { w.tasks.Wait(); close(done) }()
	t := time.NewTimer(w.cfg.Grace)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		w.log.Error("abandoned tasks still running after the grace period; leaving them behind")
	}
}

// watchReconnects counts the consumer's returns to consuming after a loss,
// looks for a stall (Stalled) and every second drops held ETA deliveries
// whose channel is gone.
func (w *Worker) watchReconnects(ctx context.Context) {
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	was := false
	lost := false
	var full time.Time
	for tick := 0; ; tick++ {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		w.checkStall(&full)
		if tick%4 == 0 {
			w.dropStaleHeld()
			w.dropStaleRated()
			w.mu.Lock()
			w.sweepCharges()
			w.mu.Unlock()
		}
		now := w.tr.ready()
		switch {
		case was && !now:
			lost = true
		case !was && now && lost:
			w.m.reconnects.Inc()
			w.log.Info("consuming again after a broker connection loss")
		}
		was = now
	}
}

// receive is the transport's handler: it must not block.
func (w *Worker) receive(d delivery) {
	if w.draining.Load() {
		_ = d.giveBack()
		return
	}
	j := &job{d: d, received: time.Now()}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.reserved[j] = struct{}{}
	w.admit(j)
}

// enqueue hands j to the task goroutines without blocking. w.mu is held.
func (w *Worker) enqueue(j *job) {
	select {
	case w.jobs <- j:
	default:
		// Cannot happen while the prefetch window is smaller than the buffer;
		// requeue rather than block the consumer.
		w.log.Error("job buffer full: requeueing delivery")
		w.requeue(j)
	}
}

// later re-enqueues j after delay. When the worker is stopping the delivery
// goes back to the broker instead; when its channel is gone, the broker
// redelivers it anyway and j is dropped.
func (w *Worker) later(j *job, delay time.Duration) { w.laterThen(j, delay, nil) }

// laterThen is later, calling then (if not nil) when the delay is over.
func (w *Worker) laterThen(j *job, delay time.Duration, then func()) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.stopping || w.draining.Load() {
		w.requeue(j)
		return
	}
	if j.d.stale() {
		// Its channel is gone: the broker redelivers it.
		delete(w.reserved, j)
		w.release(j)
		w.settled.Store(time.Now().UnixNano())
		return
	}
	// A delivery waiting for room is weighed again against the deliveries
	// on a timer, j among them (evictHeld).
	defer w.admitWaiting()
	w.timers[j] = time.AfterFunc(delay, func() {
		w.mu.Lock()
		_, ok := w.timers[j]
		delete(w.timers, j)
		w.mu.Unlock()
		if !ok {
			return
		}
		if then != nil {
			then()
		}
		w.mu.Lock()
		defer w.mu.Unlock()
		if w.stopping {
			w.requeue(j)
			return
		}
		w.enqueue(j)
	})
}

// loop is one task goroutine.
func (w *Worker) loop(ctx context.Context) {
	for w.slots.acquire(w.quit) {
		select {
		case <-w.quit:
			w.slots.release()
			return
		case <-w.slots.shrunk():
			w.slots.release() // and take one again, if there are enough
		case j := <-w.jobs:
			select {
			case <-w.quit:
				w.mu.Lock()
				w.requeue(j)
				w.mu.Unlock()
				w.slots.release()
				return
			default:
			}
			w.busy.Add(1)
			w.process(ctx, j)
			w.busy.Add(-1)
			w.slots.release()
		}
	}
}

// crash kills the process if the configured crash point is reached.
func (w *Worker) crash(point string, j *job) {
	c := w.cfg.hooks.Crash
	if c.At != point || (c.Task != "" && c.Task != j.h.name) {
		return
	}
	if w.crashed.CompareAndSwap(false, true) {
		w.log.Warn("crash injection: killing the process", zap.String("at", point), zap.String("task", j.h.name),
			zap.String("task_id", j.msg.ID))
		_ = w.log.Sync()
		w.kill()
	}
}

// checkSchema refuses to start on a record schema that is missing or older
// than the binary, or that the role lacks a privilege on: every claim would
// fail and the deliveries would wait. An error that keeps it from looking
// (the database away) is logged and the worker starts: it waits for the
// record as it does later.
func (w *Worker) checkSchema(ctx context.Context) error {
	if w.store == nil {
		return nil
	}
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	err := w.store.CheckPrivileges(cctx, idempotency.WorkerPrivileges())
	var pe *idempotency.PrivilegeError
	if errors.As(err, &pe) {
		return fmt.Errorf("tasks: the worker's PostgreSQL role %q lacks %s: grant them with '%s migrate --schema %s --grant-to %s' (or idempotency.Store.Grant) as the schema's owner",
			pe.Role, pe.Lacks(), shellquote.Quote(w.cfg.Program), shellquote.Quote(pe.Schema), shellquote.Quote(pe.Role))
	}
	if err == nil {
		err = w.store.CheckSchema(cctx)
	}
	var se *idempotency.SchemaError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &se):
		return fmt.Errorf("tasks: %w: apply it with '%s migrate --schema %s' (or the worker's --migrate, or idempotency.Store.Migrate) before starting", err, w.cfg.Program, se.Schema)
	default:
		w.log.Warn("could not check the record schema; starting anyway", zap.String("error", clip.String(err.Error(), maxLogField)))
		return nil
	}
}
