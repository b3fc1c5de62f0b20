package tasks

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the worker's Prometheus collectors; names are listed in doc.go.
type metrics struct {
	received    *prometheus.CounterVec // task
	succeeded   *prometheus.CounterVec // task
	failed      *prometheus.CounterVec // task
	retried     *prometheus.CounterVec // task
	skRetries   *prometheus.CounterVec // task, outcome
	revoked     *prometheus.CounterVec // task
	duplicates  *prometheus.CounterVec // task
	deferred    *prometheus.CounterVec // task
	stale       *prometheus.CounterVec // task, policy
	held        *prometheus.CounterVec // task
	quarantined *prometheus.CounterVec // reason
	steps       *prometheus.CounterVec // kind: chain, link, errback
	abandoned   *prometheus.CounterVec // task
	inFlight    prometheus.Gauge
	scheduled   prometheus.Gauge
	taskSeconds *prometheus.HistogramVec // task
	claimSecs   prometheus.Histogram
	reconnects  prometheus.Counter
	lapsed      prometheus.Collector // nil without a record
	memBudget   prometheus.Gauge
	memCharged  prometheus.Gauge
	memWaiting  prometheus.Gauge
	etaRequeued prometheus.Counter
	stalled     prometheus.Gauge
	collections prometheus.Counter
	recvFails   prometheus.Counter
}

// newMetrics makes the collectors and registers them with reg (none when
// nil). lapsed, when not nil, counts the record's claims whose lease has
// lapsed; it is read at each scrape.
func newMetrics(reg prometheus.Registerer, lapsed func(context.Context) (int64, error)) (*metrics, error) {
	const ns = "onceler"
	cv := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: name, Help: help}, labels)
	}
	m := &metrics{
		received:  cv("tasks_received_total", "Task messages received, by task name.", "task"),
		succeeded: cv("tasks_succeeded_total", "Tasks that ran and succeeded.", "task"),
		failed:    cv("tasks_failed_total", "Tasks that ran and failed.", "task"),
		retried:   cv("tasks_retried_total", "Tasks that asked for a Celery retry.", "task"),
		skRetries: cv("sidekiq_retry_outcomes_total", "Sidekiq jobs handed to Sidekiq's retry (a failed run, a retry asked for), by where it sent them: retried, dead, discarded.",
			"task", "outcome"),
		revoked:     cv("tasks_revoked_total", "Tasks revoked or expired before running.", "task"),
		duplicates:  cv("duplicates_suppressed_total", "Deliveries of an operation already completed: answered from the record without running.", "task"),
		deferred:    cv("deferred_total", "Deliveries deferred because the operation was in progress elsewhere.", "task"),
		stale:       cv("stale_claims_total", "Stale claims handled, by the policy applied.", "task", "policy"),
		held:        cv("held_total", "Operations held for a person to resolve.", "task"),
		quarantined: cv("quarantined_total", "Messages moved to a quarantine queue, by reason.", "reason"),
		steps:       cv("workflow_steps_published_total", "Workflow messages published: chain steps, link callbacks, errbacks.", "kind"),
		abandoned:   cv("tasks_abandoned_total", "Tasks abandoned while still running, at their hard time limit or terminated by a revoke.", "task"),
		inFlight: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "tasks_in_flight",
			Help: "Tasks running now."}),
		scheduled: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "tasks_scheduled",
			Help: "Deliveries held unacknowledged until their ETA."}),
		taskSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Name: "task_duration_seconds",
			Help: "Time from start to end of a task run.", Buckets: prometheus.ExponentialBuckets(0.0005, 4, 10)}, []string{"task"}),
		claimSecs: prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: ns, Name: "claim_duration_seconds",
			Help: "Latency of claiming an operation in the record.", Buckets: prometheus.ExponentialBuckets(0.0002, 3, 10)}),
		reconnects: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "broker_reconnects_total",
			Help: "Times the worker's consumer started consuming again after losing its channel."}),
		memBudget: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "memory_budget_bytes",
			Help: "The memory budget of the deliveries the worker holds."}),
		memCharged: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "memory_charged_bytes",
			Help: "Memory charged against the budget by the deliveries held now."}),
		memWaiting: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "deliveries_waiting_memory",
			Help: "Deliveries received and waiting, undecoded, for room in the memory budget."}),
		etaRequeued: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "eta_requeued_total",
			Help: "Deliveries due later sent back to the end of their queue because those held for their ETA filled half the memory budget."}),
		stalled: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "stalled",
			Help: "1 while the worker holds every slot without settling a delivery (readiness fails), else 0."}),
		collections: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "memory_collections_total",
			Help: "Garbage collections run before a large decode because the heap, garbage included, would pass the memory budget."}),
		recvFails: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "receive_failures_total",
			Help: "Receives from SQS and fetches from Sidekiq's Redis that failed and are tried again (each is logged)."}),
	}
	if reg == nil {
		return m, nil
	}
	cs := []prometheus.Collector{m.received, m.succeeded, m.failed, m.retried, m.skRetries, m.revoked, m.duplicates,
		m.deferred, m.stale, m.held, m.quarantined, m.steps, m.abandoned, m.inFlight, m.scheduled, m.taskSeconds, m.claimSecs, m.reconnects,
		m.memBudget, m.memCharged, m.memWaiting, m.etaRequeued, m.stalled, m.collections, m.recvFails}
	if lapsed != nil {
		m.lapsed = prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: ns, Name: "claims_lapsed",
			Help: "Claims in the record whose lease has lapsed without an outcome (read at a scrape, at most once a second; NaN when the record does not answer)."},
			(&cachedCount{count: lapsed, ttl: lapsedCacheTTL}).value)
		cs = append(cs, m.lapsed)
	}
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			var are prometheus.AlreadyRegisteredError
			if errors.As(err, &are) {
				return nil, fmt.Errorf("tasks: metrics already registered (one worker per registry): %w", err)
			}
			return nil, fmt.Errorf("tasks: register metrics: %w", err)
		}
	}
	return m, nil
}

// taskMetrics are one task's children of the per-task collectors the
// path of every delivery touches, each looked up in its vector once (at
// its first use, so that a task's series appears as before: once it
// counted something).
type taskMetrics struct {
	received, succeeded, failed lazyChild[prometheus.Counter]
	seconds                     lazyChild[prometheus.Observer]
}

type lazyChild[C any] struct {
	once sync.Once
	c    C
}

func (l *lazyChild[C]) get(with func(...string) C, task string) C {
	l.once.Do(func() { l.c = with(task) })
	return l.c
}

func (t *taskMetrics) receivedOf(m *metrics, task string) prometheus.Counter {
	return t.received.get(m.received.WithLabelValues, task)
}

func (t *taskMetrics) succeededOf(m *metrics, task string) prometheus.Counter {
	return t.succeeded.get(m.succeeded.WithLabelValues, task)
}

func (t *taskMetrics) failedOf(m *metrics, task string) prometheus.Counter {
	return t.failed.get(m.failed.WithLabelValues, task)
}

func (t *taskMetrics) secondsOf(m *metrics, task string) prometheus.Observer {
	return t.seconds.get(m.taskSeconds.WithLabelValues, task)
}

// taskMetricsOf returns h's taskMetrics: from a map read without a lock,
// copied on the (rare) write of a task seen for the first time.
func (w *Worker) taskMetricsOf(h *handler) *taskMetrics {
	if m := w.tm.Load(); m != nil {
		if t, ok := (*m)[h]; ok {
			return t
		}
	}
	w.tmMu.Lock()
	defer w.tmMu.Unlock()
	old := w.tm.Load()
	if old != nil {
		if t, ok := (*old)[h]; ok {
			return t
		}
	}
	m := make(map[*handler]*taskMetrics, 1)
	if old != nil {
		maps.Copy(m, *old)
	}
	t := &taskMetrics{}
	m[h] = t
	w.tm.Store(&m)
	return t
}

// lapsedCacheTTL is how long a count of lapsed claims answers scrapes
// before the record is asked again.
const lapsedCacheTTL = time.Second

// cachedCount is a count read from the record, asked at most once per ttl
// and by one scrape at a time (the others wait for its answer): scrapes,
// however many, make at most one query a ttl.
type cachedCount struct {
	count func(context.Context) (int64, error)
	ttl   time.Duration

	mu sync.Mutex
	at time.Time // when v was read; zero before the first read
	v  float64   // NaN when the record did not answer
}

func (c *cachedCount) value() float64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.at.IsZero() && time.Since(c.at) < c.ttl {
		return c.v
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	n, err := c.count(ctx)
	c.v, c.at = float64(n), time.Now()
	if err != nil {
		c.v = math.NaN()
	}
	return c.v
}
