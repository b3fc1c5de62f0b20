package tasks

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/control"
)

// The worker's side of Celery's run-time remote commands (control.Tuner):
// rate limits, time limits, queues consumed, task slots, settings.

var _ control.Tuner = (*Worker)(nil)

// maxSlots bounds the task slots pool_grow and autoscale may ask for.
const maxSlots = 10000

// taskTuning holds the limits set at run time, by task name, and the rate
// limiters.
type taskTuning struct {
	// set: a rate or time limit has been set at run time. Until then a
	// delivery whose task has no RateLimit reads neither map nor lock.
	set atomic.Bool
	mu  sync.Mutex
	// rates: a rate limit set by rate_limit (0: none), overriding the
	// task's RateLimit.
	rates map[string]float64
	// limits: time limits set by time_limit, overriding the task's.
	limits map[string]timeLimits
	// buckets: the token buckets of the rate-limited tasks.
	buckets map[string]*bucket
}

type timeLimits struct{ soft, hard time.Duration }

// bucket is a token bucket of capacity 1, Celery's (kombu's TokenBucket
// with capacity 1): one task may start every interval; the tasks waiting
// start in turn.
type bucket struct {
	interval time.Duration
	next     time.Time // when the next task may start
	// waiting are the jobs holding a start ahead (job.rateAt), in start
	// order: a start given back (its delivery lost with its channel, or
	// republished after Config.MaxHold) moves the later ones up.
	waiting []*job
}

// maxRateInterval bounds the interval of a rate limit: a rate so low that
// one start in this long is as good as none ("1e-12/s") waits this long,
// instead of overflowing a time.Duration.
const maxRateInterval = 100 * 365 * 24 * time.Hour

// rateInterval is the interval between starts at r per second.
func rateInterval(r float64) time.Duration {
	f := float64(time.Second) / r
	if math.IsNaN(f) || f >= float64(maxRateInterval) {
		return maxRateInterval
	}
	return max(time.Duration(f), 1)
}

// reserve takes the next start time for j and returns how long to wait
// for it; a job that waits is in waiting until it starts or gives its start
// back.
func (b *bucket) reserve(j *job, now time.Time) time.Duration {
	start := now
	if b.next.After(now) {
		start = b.next
	}
	b.next = start.Add(b.interval)
	// Starts of jobs long gone otherwise (revoked while waiting) are let go.
	b.waiting = slices.DeleteFunc(b.waiting, func(o *job) bool { return o.rateAt.Before(now.Add(-time.Minute)) })
	wait := start.Sub(now)
	if wait > 0 {
		j.rateBucket, j.rateAt = b, start
		b.waiting = append(b.waiting, j)
	}
	return wait
}

// rate returns the rate limit in force for h, per second (0: none).
func (t *taskTuning) rate(h *handler) float64 {
	if r, ok := t.rates[h.name]; ok {
		return r
	}
	return h.rateLimit
}

// rateDelay reserves a start for j and returns how long it must wait for
// it (0: it may start now).
func (w *Worker) rateDelay(j *job) time.Duration {
	t := &w.tuning
	h := j.h
	if h.rateLimit <= 0 && !t.set.Load() {
		return 0
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.rate(h)
	if r <= 0 {
		return 0
	}
	interval := rateInterval(r)
	b := t.buckets[h.name]
	if b == nil || b.interval != interval {
		if t.buckets == nil {
			t.buckets = make(map[string]*bucket)
		}
		b = &bucket{interval: interval}
		t.buckets[h.name] = b
	}
	return b.reserve(j, time.Now())
}

// rateLimited holds j until its task's rate limit lets it start (without
// a task slot meanwhile) and reports whether it did; a delivery held once
// is not held again. A wait longer than Config.MaxHold is cut to MaxHold:
// then the delivery gives its start back, is republished to its queue and
// acknowledged (as a hold for an ETA is), and the copy waits in its turn.
func (w *Worker) rateLimited(ctx context.Context, j *job) bool {
	if j.rateRehold {
		j.rateRehold = false
		w.rateGiveBack(j)
		w.republishHeld(ctx, j, "held delivery republished (max hold reached before its rate limit let it start)")
		return true
	}
	if j.rated {
		w.rateStarted(j)
		return false
	}
	j.rated = true
	d := w.rateDelay(j)
	if d <= 0 {
		return false
	}
	if mh := w.cfg.MaxHold; mh > 0 && d > mh {
		d, j.rateRehold = mh, true
	}
	w.later(j, d)
	return true
}

// rateStarted takes j, whose start has come, off its bucket's waiting.
func (w *Worker) rateStarted(j *job) {
	t := &w.tuning
	t.mu.Lock()
	defer t.mu.Unlock()
	if b := j.rateBucket; b != nil {
		b.waiting = slices.DeleteFunc(b.waiting, func(o *job) bool { return o == j })
		j.rateBucket = nil
	}
}

// rateGiveBack gives back the start j waits for (its delivery is gone, or
// republished): the jobs waiting after it move up by one interval, their
// timers with them, as Celery clears the pending starts on a connection
// loss.
func (w *Worker) rateGiveBack(j *job) {
	t := &w.tuning
	t.mu.Lock()
	b := j.rateBucket
	if b == nil {
		t.mu.Unlock()
		return
	}
	j.rateBucket = nil
	var moved []*job
	var at []time.Time
	if i := slices.Index(b.waiting, j); i >= 0 {
		b.waiting = slices.Delete(b.waiting, i, i+1)
		for _, o := range b.waiting[i:] {
			o.rateAt = o.rateAt.Add(-b.interval)
			moved, at = append(moved, o), append(at, o.rateAt)
		}
		b.next = b.next.Add(-b.interval)
	}
	t.mu.Unlock()
	if len(moved) == 0 {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	for k, o := range moved {
		// A timer that fired already runs its job at the old start.
		if tm, ok := w.timers[o]; ok && tm.Stop() {
			tm.Reset(max(0, time.Until(at[k])))
		}
	}
}

// dropStaleRated forgets the deliveries waiting for their task's rate limit
// whose channel is gone (the broker redelivers them) and gives their starts
// back, so that the redelivered copies do not wait behind them.
func (w *Worker) dropStaleRated() {
	var gone []*job
	w.mu.Lock()
	for j, tm := range w.timers {
		if j.rateBucket == nil || !j.d.stale() {
			continue
		}
		tm.Stop()
		delete(w.timers, j)
		delete(w.reserved, j)
		w.release(j)
		gone = append(gone, j)
	}
	w.mu.Unlock()
	if len(gone) == 0 {
		return
	}
	w.settled.Store(time.Now().UnixNano())
	for _, j := range gone {
		w.rateGiveBack(j)
	}
	w.log.Info("deliveries waiting for a rate limit lost with their channel; the broker redelivers them", zap.Int("count", len(gone)))
}

// SetRateLimit sets task's rate limit, in Celery's syntax ("10/s", "10/m",
// "10/h"; "" or "0": none), over the task's RateLimit.
func (w *Worker) SetRateLimit(task, rate string) error {
	if _, ok := w.reg.get(task); !ok {
		return fmt.Errorf("tasks: rate limit of %q: %w", task, control.ErrUnknownTask)
	}
	r, err := control.ParseRate(rate)
	if err != nil {
		return err
	}
	t := &w.tuning
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.rates == nil {
		t.rates = make(map[string]float64)
	}
	t.rates[task] = r
	t.set.Store(true)
	delete(t.buckets, task)
	return nil
}

// SetTimeLimit sets task's soft and hard time limits over the task's
// TimeLimit and SoftTimeLimit (0: none; then the message's apply).
func (w *Worker) SetTimeLimit(task string, soft, hard time.Duration) error {
	if _, ok := w.reg.get(task); !ok {
		return fmt.Errorf("tasks: time limit of %q: %w", task, control.ErrUnknownTask)
	}
	t := &w.tuning
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.limits == nil {
		t.limits = make(map[string]timeLimits)
	}
	t.limits[task] = timeLimits{soft: soft, hard: hard}
	t.set.Store(true)
	return nil
}

// limitsOf is h's time limits: as set by time_limit, else as registered.
func (w *Worker) limitsOf(h *handler) timeLimits {
	t := &w.tuning
	if !t.set.Load() {
		return timeLimits{soft: h.softTimeLimit, hard: h.timeLimit}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if l, ok := t.limits[h.name]; ok {
		return l
	}
	return timeLimits{soft: h.softTimeLimit, hard: h.timeLimit}
}

// AddQueue starts consuming q, declared as a configured queue is (with its
// quarantine queue).
func (w *Worker) AddQueue(q amqp.QueueSpec) error {
	t, ok := w.tr.(*amqpTransport)
	if !ok {
		return errNoQueues
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := t.addQueue(ctx, q); err != nil {
		return err
	}
	w.log.Info("consuming a queue added at run time", zap.String("queue", q.Name))
	return nil
}

// errNoQueues: the worker's transport has no AMQP queues to add or cancel.
var errNoQueues = errors.New("tasks: the worker does not consume AMQP queues")

// CancelQueue stops consuming the queue named; the deliveries taken from it
// already run.
func (w *Worker) CancelQueue(name string) error {
	t, ok := w.tr.(*amqpTransport)
	if !ok {
		return errNoQueues
	}
	was, err := t.consumer.CancelQueue(name)
	if err != nil {
		return fmt.Errorf("tasks: %w", err)
	}
	if was {
		w.log.Info("no longer consuming a queue", zap.String("queue", name))
	}
	return nil
}

// PoolSize returns the number of task slots: how many tasks may run at
// once.
func (w *Worker) PoolSize() int { return w.slots.size(w.cfg.Concurrency) }

// SetPoolSize sets the number of task slots (1 to 10,000) and returns it.
// Slots taken away are given up as their tasks end; running tasks are not
// interrupted. The prefetch window stays Config.Prefetch.
func (w *Worker) SetPoolSize(n int) int {
	return w.slots.resize(max(1, min(n, maxSlots)))
}

// Settings returns the worker's settings under Celery's names: those that
// differ from Celery's defaults, or with withDefaults all of them. URLs are
// given without their password.
func (w *Worker) Settings(withDefaults bool) map[string]any {
	cfg := &w.cfg
	backend := cfg.ResultBackend
	if backend == "" {
		backend = "rpc://"
	}
	broker := w.brokerInfo()
	var routes any
	if len(cfg.Routes) > 0 {
		r := make(map[string]any, len(cfg.Routes))
		for k, v := range cfg.Routes {
			r[k] = map[string]any{"queue": v}
		}
		routes = r
	}
	type setting struct {
		name      string
		value, by any // by: Celery's default
	}
	all := []setting{
		{"broker_url", amqp.RedactURL(brokerURL(cfg.Broker)), nil},
		{"broker_heartbeat", broker["heartbeat"], 120.0},
		{"broker_connection_timeout", broker["connect_timeout"], 4.0},
		{"result_backend", redactBackend(backend), nil},
		{"result_serializer", cfg.ResultSerializer, "json"},
		{"result_expires", cfg.ResultExpires.Seconds(), 86400.0},
		{"result_extended", cfg.ResultExtended, false},
		{"task_track_started", cfg.TrackStarted, false},
		{"task_acks_late", true, false},
		{"task_routes", routes, nil},
		{"task_serializer", "json", "json"},
		{"accept_content", []any{"json"}, []any{"json"}},
		{"task_time_limit", nil, nil},
		{"task_soft_time_limit", nil, nil},
		{"worker_concurrency", w.PoolSize(), nil},
		{"worker_prefetch_multiplier", max(1, cfg.Prefetch/max(1, cfg.Concurrency)), 4},
		{"worker_send_task_events", cfg.TaskEvents, false},
		{"worker_disable_rate_limits", false, false},
		{"worker_direct", false, false},
		{"event_exchange", control.EventExchange, control.EventExchange},
		{"control_exchange", "celery", "celery"},
		{"enable_utc", true, true},
	}
	if cfg.ResultSerializer == "" {
		all[4].value = "json"
	}
	out := make(map[string]any, len(all))
	for _, s := range all {
		if withDefaults || fmt.Sprint(s.value) != fmt.Sprint(s.by) {
			out[s.name] = s.value
		}
	}
	return out
}

// brokerInfo is kombu's Connection.info() of the worker's broker
// connection, without the password (inspect stats "broker").
func (w *Worker) brokerInfo() map[string]any {
	heartbeat, dialTimeout := w.cfg.Broker.Heartbeat, w.cfg.Broker.DialTimeout
	if heartbeat <= 0 {
		heartbeat = amqp.DefaultHeartbeat
	}
	if dialTimeout <= 0 {
		dialTimeout = 30 * time.Second
	}
	return control.BrokerInfo(brokerURL(w.cfg.Broker), heartbeat, dialTimeout)
}

// slotGate bounds the tasks running at once to its limit: a task goroutine
// takes a slot before it takes a delivery and gives it back after. There
// are as many task goroutines as the largest limit set so far.
type slotGate struct {
	mu      sync.Mutex
	limit   int // 0: not set yet (Config.Concurrency)
	inUse   int
	spawned int
	spawn   func() // starts one more task goroutine (nil: not running)
	stopped bool
	waiting int           // goroutines waiting for a slot
	wake    chan struct{} // closed when a slot may have been freed
	// shrink is closed when the limit goes down: the goroutines holding a
	// slot while they wait for a delivery give it back and take one again.
	shrink chan struct{}
}

// shrunk returns a channel closed when the limit goes down.
func (g *slotGate) shrunk() <-chan struct{} {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.shrink == nil {
		g.shrink = make(chan struct{})
	}
	return g.shrink
}

func (g *slotGate) size(def int) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.limit == 0 {
		return def
	}
	return g.limit
}

// start runs the task goroutines under the limit (def unless set before).
func (g *slotGate) start(def int, spawn func()) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.limit == 0 {
		g.limit = def
	}
	g.spawn = spawn
	g.wake = make(chan struct{})
	g.grow()
}

// stop starts no more task goroutines: Run waits for those it has.
func (g *slotGate) stop() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.stopped = true
}

// grow starts task goroutines up to the limit; g.mu is held.
func (g *slotGate) grow() {
	for g.spawn != nil && !g.stopped && g.spawned < g.limit {
		g.spawned++
		g.spawn()
	}
}

func (g *slotGate) resize(n int) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	if n < g.limit && g.shrink != nil {
		close(g.shrink)
		g.shrink = make(chan struct{})
	}
	g.limit = n
	g.grow()
	g.signal()
	return n
}

// signal wakes the goroutines waiting for a slot; g.mu is held.
func (g *slotGate) signal() {
	if g.wake != nil {
		close(g.wake)
		g.wake = make(chan struct{})
	}
}

// acquire takes a slot, waiting until one is free; false when quit is
// closed first.
func (g *slotGate) acquire(quit <-chan struct{}) bool {
	for {
		g.mu.Lock()
		if g.inUse < g.limit {
			g.inUse++
			g.mu.Unlock()
			return true
		}
		wake := g.wake
		g.waiting++
		g.mu.Unlock()
		var woken bool
		select {
		case <-wake:
			woken = true
		case <-quit:
		}
		g.mu.Lock()
		g.waiting--
		g.mu.Unlock()
		if !woken {
			return false
		}
	}
}

func (g *slotGate) release() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.inUse--
	if g.waiting > 0 {
		g.signal()
	}
}

// redactBackend is a result backend URL without its password, in the
// user information or in a query parameter (?password=, which pgx and
// the Redis client read).
func redactBackend(u string) string {
	if !strings.Contains(u, "@") && !strings.Contains(strings.ToLower(u), "password") {
		return u
	}
	return redactURL(u)
}
