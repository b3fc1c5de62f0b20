package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"go.uber.org/zap"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testkit"
	"github.com/onceler/onceler/sidekiq"
	"github.com/onceler/onceler/tasks"
)

// The measured consumers run in a child process (this binary started again
// with -child), so that the peak RSS read from /proc/self/status is theirs
// alone. The parent hands the job over as JSON in the environment; the child
// prints "READY" when it consumes and one "RESULT <json>" line at the end.

const childEnv = "ONCELER_BENCH_CHILD"

// childJob is what one child process does.
type childJob struct {
	Kind        string // "raw", "worker", "sidekiq-raw", "sidekiq", "sqs-raw" or "sqs"
	AMQPURL     string
	DatabaseURL string
	Queue       string
	Schema      string // record schema (worker)
	Expect      int    // deliveries to finish before stopping
	Prefetch    int
	Concurrency int
	PoolConns   int
	Flushers    int           // record batch flushers (0: the store's default)
	Linger      time.Duration // record batch linger (0: the store's default, negative: none)
	GroupTx     int           // same-database tasks per group transaction (0: none)
	Timeout     time.Duration
	CPUProfile  string
	MemProfile  string
	Debug       bool
	GOGC        int    // 0: the runtime's default
	Procs       int    // GOMAXPROCS; 0: the runtime's default
	DoneFile    string // when set, the commit time of each task is written there
	Stages      bool   // and the times of its task-received and task-started events
	Events      bool   // remote control on, task events on (Celery's -E)

	ResultBackend string // the worker's result backend ("": rpc://)

	// SidekiqURL: the Sidekiq scenarios' Redis; Queue is then the Sidekiq
	// queue and Identity the consumer's Sidekiq identity.
	SidekiqURL string
	Identity   string

	// SQSEndpoint: the SQS scenarios' server; Queue is then the SQS queue.
	SQSEndpoint string
}

// childResult is what the child reports.
type childResult struct {
	Done       int           // deliveries finished (acked, or answered by the worker)
	First      time.Time     // first finished
	Last       time.Time     // Expect-th finished
	Elapsed    time.Duration // Last - First
	PeakRSSKiB int64         // VmHWM
	CPU        time.Duration // user + system CPU time of this process while consuming
	PGCPU      time.Duration // CPU time of the worker's PostgreSQL backends (their whole life)
	Counts     map[string]float64
	Err        string
}

func childMain() error {
	var job childJob
	if err := json.Unmarshal([]byte(os.Getenv(childEnv)), &job); err != nil {
		return fmt.Errorf("child: read job: %w", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), job.Timeout)
	defer cancel()
	if job.GOGC > 0 {
		debug.SetGCPercent(job.GOGC)
	}
	if job.Procs > 0 {
		runtime.GOMAXPROCS(job.Procs)
	}
	var res childResult
	var err error
	switch job.Kind {
	case "raw":
		res, err = runRaw(ctx, job)
	case "worker", "sidekiq", "sqs":
		res, err = runWorkerChild(ctx, job)
	case "sqs-raw":
		res, err = runSQSRaw(ctx, job)
	case "sidekiq-raw":
		res, err = runSidekiqRaw(ctx, job)
	default:
		err = fmt.Errorf("child: unknown kind %q", job.Kind)
	}
	if err != nil {
		res.Err = err.Error()
	}
	res.PeakRSSKiB = peakRSS()
	b, _ := json.Marshal(res)
	fmt.Printf("RESULT %s\n", b)
	return nil
}

// runRaw is the ceiling: consume with the same prefetch and ack each
// delivery, nothing else.
func runRaw(ctx context.Context, job childJob) (childResult, error) {
	var res childResult
	conn, err := amqp091.Dial(job.AMQPURL)
	if err != nil {
		return res, fmt.Errorf("raw: dial: %w", err)
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		return res, fmt.Errorf("raw: channel: %w", err)
	}
	if err := ch.Qos(job.Prefetch, 0, true); err != nil {
		return res, fmt.Errorf("raw: qos: %w", err)
	}
	in, err := ch.ConsumeWithContext(ctx, job.Queue, "bench-raw", false, false, false, false, nil)
	if err != nil {
		return res, fmt.Errorf("raw: consume: %w", err)
	}
	var obs *doneObserver
	if job.DoneFile != "" {
		obs = newDoneObserver(job.Expect)
	}
	fmt.Println("READY")
	stop := startProfile(job)
	defer stop()
	cpu0 := testkit.CPUTime()
	for res.Done < job.Expect {
		select {
		case <-ctx.Done():
			return res, fmt.Errorf("raw: %d of %d after the timeout", res.Done, job.Expect)
		case d, ok := <-in:
			if !ok {
				return res, errors.New("raw: delivery channel closed")
			}
			if err := d.Ack(false); err != nil {
				return res, fmt.Errorf("raw: ack: %w", err)
			}
			res.Done++
			now := time.Now()
			if obs != nil {
				obs.done[d.CorrelationId] = taskTimes{done: now}
			}
			if res.Done == 1 {
				res.First = now
			}
			res.Last = now
		}
	}
	res.CPU = testkit.CPUTime() - cpu0
	res.Elapsed = res.Last.Sub(res.First)
	if obs != nil {
		if err := obs.write(job.DoneFile); err != nil {
			return res, fmt.Errorf("raw: done file: %w", err)
		}
	}
	return res, nil
}

var _ tasks.TaskEventObserver = (*doneObserver)(nil)

// outsideArgs are the arguments of the bench tasks: one operation id.
type outsideArgs struct {
	Op string `celery:"op"`
}

// benchRegistry registers the bench tasks: an outside-system no-op (claim,
// then completion), demo.ledger.credit's statement run by a RunTx function
// ((b'-tx)), and the onceler binary's demo tasks (demo.ledger.credit, whose
// statement RunStmt returns).
func benchRegistry(pool *pgxpool.Pool) (*tasks.Registry, error) {
	reg := tasks.NewRegistry()
	key := func(a outsideArgs) (string, error) { return a.Op, nil }
	err := tasks.Register(reg, tasks.Task[outsideArgs]{
		Name: taskOutside, Mode: tasks.ModeOutside, Key: key, Policy: tasks.PolicyRetry,
		Run: func(ctx context.Context, c *tasks.Call, a outsideArgs) (any, error) { return nil, nil },
	})
	if err != nil {
		return nil, err
	}
	err = tasks.Register(reg, tasks.Task[demo.CreditArgs]{
		Name: taskCreditTx, Mode: tasks.ModeSameDB,
		Key: func(a demo.CreditArgs) (string, error) { return a.EntryID, nil },
		RunTx: func(ctx context.Context, tx pgx.Tx, c *tasks.Call, a demo.CreditArgs) (any, error) {
			var balance int64
			if err := tx.QueryRow(ctx, demo.CreditSQL, a.EntryID, a.Account, a.Cents, c.TaskID).Scan(&balance); err != nil {
				return nil, err
			}
			return demo.CreditResult{EntryID: a.EntryID, Account: a.Account, Balance: balance}, nil
		},
	})
	if err != nil {
		return nil, err
	}
	return reg, demo.Register(reg, pool)
}

// runWorkerChild runs the onceler worker in this process until it has
// answered job.Expect deliveries, then shuts it down gracefully.
func runWorkerChild(ctx context.Context, job childJob) (childResult, error) {
	var res childResult
	pcfg, err := pgxpool.ParseConfig(job.DatabaseURL)
	if err != nil {
		return res, fmt.Errorf("worker: database url: %w", err)
	}
	// The pool the onceler command opens for its worker.
	pcfg.MaxConns = tasks.DefaultPoolConns
	if job.PoolConns > 0 {
		pcfg.MaxConns = int32(job.PoolConns)
	}
	pcfg.ConnConfig.RuntimeParams["application_name"] = "onceler-bench-worker"
	if v := os.Getenv("ONCELER_BENCH_PG_PARAMS"); v != "" {
		for _, kv := range strings.Split(v, ",") {
			if k, val, ok := strings.Cut(kv, "="); ok {
				pcfg.ConnConfig.RuntimeParams[k] = val
			}
		}
	}
	tracer := &batchTracer{}
	if job.Debug {
		pcfg.ConnConfig.Tracer = tracer
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return res, fmt.Errorf("worker: pool: %w", err)
	}
	defer pool.Close()
	log := zap.NewNop()
	store, err := idempotency.New(pool, idempotency.Config{Schema: job.Schema, Logger: log,
		Batch: idempotency.BatchConfig{Flushers: job.Flushers, Linger: job.Linger, GroupTx: job.GroupTx}})
	if err != nil {
		return res, fmt.Errorf("worker: store: %w", err)
	}
	defer store.Close()
	reg, err := benchRegistry(pool)
	if err != nil {
		return res, fmt.Errorf("worker: registry: %w", err)
	}
	metrics := newCountingRegistry()
	var obs *doneObserver
	var taskObs tasks.Observer // stays a nil interface without DoneFile or Events
	if job.DoneFile != "" {
		obs = newDoneObserver(job.Expect)
		obs.stages = job.Stages
		taskObs = obs
	}
	hostname := "onceler-bench@" + strconv.Itoa(os.Getpid())
	if job.Events && obs != nil {
		return res, errors.New("worker: events and a done file together are not supported")
	}
	w, err := tasks.NewWorker(reg, tasks.Config{
		Broker:      amqp.Config{URL: job.AMQPURL, Name: "onceler-bench-worker", Logger: log},
		Queues:      []amqp.QueueSpec{amqp.CeleryQueue(job.Queue)},
		Pool:        pool,
		Store:       store,
		Concurrency: job.Concurrency,
		Prefetch:    job.Prefetch,
		Hostname:    hostname,
		Logger:      log,
		Metrics:     metrics,
		Grace:       10 * time.Second,
		Observer:    taskObs,
		// With events, the worker's remote control sends them (and its
		// heartbeats); without, there is none, as before.
		NoControl:  !job.Events,
		TaskEvents: job.Events,

		ResultBackend: job.ResultBackend,
		Sidekiq:       sidekiqConfig(job, log),
		SQS:           sqsConfig(job, log),
	})
	if err != nil {
		return res, fmt.Errorf("worker: %w", err)
	}
	wctx, stopWorker := context.WithCancel(ctx)
	defer stopWorker()
	runErr := make(chan error, 1)
	go func() { runErr <- w.Run(wctx) }()

	for !w.Ready() {
		select {
		case err := <-runErr:
			return res, fmt.Errorf("worker stopped before consuming: %w", err)
		case <-ctx.Done():
			return res, errors.New("worker: not ready before the timeout")
		case <-time.After(5 * time.Millisecond):
		}
	}
	fmt.Println("READY")
	cpu0 := testkit.CPUTime()
	stopProfile := startProfile(job)
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	var waitErr error
	for res.Done < job.Expect && waitErr == nil {
		select {
		case err := <-runErr:
			waitErr = fmt.Errorf("worker stopped: %v", err)
			runErr <- err
		case <-ctx.Done():
			waitErr = fmt.Errorf("worker: %d of %d after the timeout", res.Done, job.Expect)
		case now := <-tick.C:
			n := metrics.answered()
			if n > 0 && res.First.IsZero() {
				res.First = now
			}
			if n > res.Done {
				res.Done, res.Last = n, now
			}
		}
	}
	res.CPU = testkit.CPUTime() - cpu0
	stopProfile()
	res.Elapsed = res.Last.Sub(res.First)
	res.Counts = counters(metrics.Registry)
	st := store.BatchStats()
	res.Counts["record_flushes"], res.Counts["tx_groups"], res.Counts["tx_grouped"], res.Counts["tx_alone"] =
		float64(st.Flushes), float64(st.TxGroups), float64(st.TxGrouped), float64(st.TxAlone)
	if job.Debug {
		for k, v := range tracer.summary() {
			res.Counts[k] = v
		}
	}
	stopWorker()
	if err := <-runErr; err != nil && waitErr == nil {
		waitErr = fmt.Errorf("worker: %w", err)
	}
	if ctl := w.Controller(); ctl != nil {
		// Stopped with the worker (Run returned).
		sent, dropped, _ := ctl.Counters()
		res.Counts["events_sent"], res.Counts["events_dropped"] = float64(sent), float64(dropped)
	}
	res.PGCPU = backendCPU(context.WithoutCancel(ctx), pool)
	if obs != nil && waitErr == nil {
		waitErr = obs.write(job.DoneFile)
	}
	return res, waitErr
}

// sidekiqConfig is the worker's Sidekiq configuration in the Sidekiq
// scenarios, else nil.
func sidekiqConfig(job childJob, log *zap.Logger) *sidekiq.Config {
	if job.SidekiqURL == "" {
		return nil
	}
	return &sidekiq.Config{URL: job.SidekiqURL, Queues: []string{job.Queue}, Identity: job.Identity, Logger: log}
}

// counters sums the worker's counters over their labels.
func counters(reg *prometheus.Registry) map[string]float64 {
	out := map[string]float64{}
	mfs, err := reg.Gather()
	if err != nil {
		return out
	}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			if c := m.GetCounter(); c != nil {
				out[mf.GetName()] += c.GetValue()
			}
			if h := m.GetHistogram(); h != nil {
				out[mf.GetName()+"_sum"] += h.GetSampleSum()
				out[mf.GetName()+"_count"] += float64(h.GetSampleCount())
			}
		}
	}
	return out
}

// startProfile starts the CPU profile (when asked) and returns what stops it
// and writes the allocation profile.
func startProfile(job childJob) func() {
	var cpu *os.File
	if job.CPUProfile != "" {
		f, err := os.Create(job.CPUProfile)
		if err == nil && pprof.StartCPUProfile(f) == nil {
			cpu = f
		}
	}
	return func() {
		if cpu != nil {
			pprof.StopCPUProfile()
			_ = cpu.Close()
			cpu = nil
		}
		if job.MemProfile != "" {
			if f, err := os.Create(job.MemProfile); err == nil {
				runtime.GC()
				_ = pprof.Lookup("allocs").WriteTo(f, 0)
				_ = f.Close()
			}
			job.MemProfile = ""
		}
	}
}

// peakRSS is this process's VmHWM in KiB.
func peakRSS() int64 {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0
	}
	defer func() { _ = f.Close() }()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
			n, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return n
		}
	}
	return 0
}

// backendCPU sums the CPU time of the pool's PostgreSQL backends (the
// server runs on this machine), read from /proc/<pid>/stat.
func backendCPU(ctx context.Context, pool *pgxpool.Pool) time.Duration {
	rows, err := pool.Query(ctx, `SELECT pid FROM pg_stat_activity WHERE application_name = 'onceler-bench-worker'`)
	if err != nil {
		return 0
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return 0
	}
	var total time.Duration
	for _, pid := range pids {
		total += procCPU(int(pid))
	}
	return total
}

// procCPU is the user and system CPU time of process pid so far, read from
// /proc/<pid>/stat; 0 when it cannot be read.
func procCPU(pid int) time.Duration {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0
	}
	// Fields after the command name (which is in parentheses): utime and
	// stime are fields 14 and 15, in clock ticks (100 per second).
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(f) < 13 {
		return 0
	}
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(ut+st) * 10 * time.Millisecond
}

// brokerPID is the process id of the local RabbitMQ node (beam.smp), 0 when
// there is none on this machine.
func brokerPID() int {
	dirs, _ := os.ReadDir("/proc")
	for _, d := range dirs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		if comm, err := os.ReadFile("/proc/" + d.Name() + "/comm"); err == nil && strings.TrimSpace(string(comm)) == "beam.smp" {
			return pid
		}
	}
	return 0
}
