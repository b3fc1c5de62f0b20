package cmd

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/control"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/workerhooks"
	"github.com/onceler/onceler/sidekiq"
	"github.com/onceler/onceler/tasks"
)

// DefaultBrokerURL is the broker of a local RabbitMQ, in Celery's spelling.
const DefaultBrokerURL = "amqp://guest:guest@localhost:5672//"

type workerFlags struct {
	db           dbFlags
	broker       brokerFlags
	queues       string
	queueArgs    []string
	quorum       bool
	concurrency  int
	prefetch     int
	lease        time.Duration
	grace        time.Duration
	hostname     string
	httpAddr     string
	resultSer    string
	resultBE     string
	resultExp    time.Duration
	resultExt    bool
	trackStarted bool
	logLevel     string
	logFormat    string
	logArguments bool
	noRecord     bool
	migrate      bool
	events       bool
	noControl    bool
	groupTx      int
	flushers     int
	memBudget    string
	stallAfter   time.Duration
	sidekiqURL   string
	sidekiqBeat  time.Duration
	queuesSet    bool // --queues (or its variable) was given
}

func (f *workerFlags) defineLog(fs *flagSet) {
	fs.String(&f.logLevel, "log-level", "LEVEL", "info", "log level: debug, info, warn or error")
	fs.String(&f.logFormat, "log-format", "FORMAT", "console", "log format: json (one object a line) or console (for people)")
}

func workerCommand() *command {
	return &command{
		name:    "worker",
		summary: "consume Celery tasks from RabbitMQ (or Sidekiq jobs from Redis) and run them once each",
		long: `Runs a worker: consumes the queues, runs each task with the idempotency
record (claim, run, complete, reply, then acknowledge), and answers duplicates
with the stored result. SIGINT or SIGTERM stops it gracefully: no new tasks,
running ones get --grace to finish, unfinished deliveries return to the queue.
A second signal ends the process at once.

It serves the tasks the binary registers (cmd.App): onceler's own binary
the demo tasks, a binary built as docs/example is its own.

With --sidekiq redis://host:port/db it consumes Sidekiq jobs instead, with
the same tasks, record and commands: a job's class is the task's name, a
failed job goes to Sidekiq's retry set, then its dead set; a TERM or TSTP
sent through Sidekiq's API stops or quiets it (docs/sidekiq.md).

ONCELER_CRASH_AT=after_claim|after_effect|before_ack|chord_joined with
ONCELER_CRASH_TASK=<task> makes the process die abruptly (as kill -9) the
first time that point is reached, for crash tests.`,
		setup: func(a *app, fs *flagSet) func(context.Context, []string) error {
			f := &workerFlags{}
			f.db.define(fs)
			f.broker.define(fs)
			fs.String(&f.queues, "queues", "LIST", "celery", "comma-separated queues to consume: one that exists is consumed as the application declared it, a missing one is declared as Celery declares it (see --queue-arg, --quorum); each gets a quarantine queue <queue>.quarantine. With --sidekiq: Sidekiq's queues (default: default), in strict order, or weighted when a number follows a name (critical,2,default,1), as Sidekiq's -q critical,2 -q default,1")
			fs.Secret(&f.sidekiqURL, "sidekiq", "URL", "", "consume Sidekiq jobs from this Redis (redis://[[user]:password@]host[:port][/db], rediss:// for TLS) instead of Celery messages from RabbitMQ: a job's class is the task's name, its args the arguments (docs/sidekiq.md); no remote control nor events then")
			fs.Duration(&f.sidekiqBeat, "sidekiq-heartbeat", 5*time.Second, "with --sidekiq, the interval of the process heartbeat Sidekiq's tools read; the heartbeat lives 12 times as long, after which the process counts as dead and another worker recovers the jobs it held")
			fs.List(&f.queueArgs, "queue-arg", "[QUEUE:]ARG=VALUE", "an argument to declare a missing queue with, for every queue of --queues or, with QUEUE:, for that one; repeat the flag or separate items with commas, e.g. --queue-arg x-max-priority=10. An integer value is sent as an integer, true and false as booleans, anything else (or a value in double quotes) as a string. A queue that exists is consumed as it is, with the arguments the application declared it with (docs/queues.md)")
			fs.Bool(&f.quorum, "quorum", "declare missing queues as quorum queues (x-queue-type=quorum); a queue that exists is consumed as it is")
			fs.Int(&f.concurrency, "concurrency", 0, "tasks run at once; 0 means 64 × CPUs, at least 256 (goroutines are cheap, and many in flight fill the record's batches and transaction groups)")
			fs.Int(&f.prefetch, "prefetch", 0, "unacknowledged deliveries the broker may hand over; 0 means 4 × concurrency up to 256 but at least the concurrency, or the concurrency when a queue consumed is a priority queue (x-max-priority), so that the tasks waiting for a slot stay in the broker, where priorities apply")
			fs.Duration(&f.lease, "lease", 30*time.Second, "claim lease of tasks that do not set their own; renewed while the task runs, so a claim goes stale this long after its worker died")
			fs.Int(&f.groupTx, "group-tx", 0, "same-database tasks in one transaction, committed once (a group commit: fewer commits, more throughput for short tasks; a task that fails is rolled back alone). 0 means adaptive: a task that finds no other running commits at once, tasks that come while others run share the next group, sized to about 20 ms of their functions' time, one group at a time; tasks slower than 5 ms run alone. 1 means each in a transaction of its own; N (at most 32) means groups of up to N, four at once")
			fs.Int(&f.flushers, "flushers", 0, "record flushes running at once, each a batch of claims and completions committed once on a connection of its own; 0 means the record's default, 1, which makes the largest batches and the fewest commits (the fastest with the broker and PostgreSQL on the worker's machine); 2 may gain on a database server with cores to spare; at most 16")
			fs.String(&f.memBudget, "memory-budget", "SIZE", "", "memory for the deliveries held (being decoded, waiting, running, held for their ETA), e.g. 512MiB or 2GiB; past it no more deliveries are taken until some are settled, and a message that needs more is quarantined (docs/limits.md); empty means a quarter of the cgroup's or machine's memory, from 64 MiB to 2 GiB. The Go memory limit is set to it plus 64 MiB unless GOMEMLIMIT is set")
			fs.Duration(&f.stallAfter, "stall-after", time.Minute, "/readyz answers 503 while every slot is held (all tasks running, the prefetch window full, or deliveries waiting for memory) and no delivery was settled for this long")
			fs.Duration(&f.grace, "grace", 30*time.Second, "on shutdown, how long running tasks may take to finish before they are cancelled")
			fs.String(&f.hostname, "hostname", "NAME", control.DefaultNodeName, "node name, as Celery's -n: %h is the host name, %n its first label, %d its domain, %p the process id; the default is unique per process, a fixed name must differ between the workers on a host")
			fs.Bool(&f.events, "events", "send task events (Celery's -E) for Flower and 'celery events'; worker heartbeats are always sent")
			fs.Bool(&f.noControl, "no-control", "do not answer Celery remote control ('celery inspect', 'celery control') nor send worker events")
			fs.String(&f.httpAddr, "http-addr", "ADDR", "", "serve /metrics (Prometheus), /healthz and /readyz, and nothing else, on this address: a port alone or :port listens on the loopback interface (127.0.0.1) only, host:port on that host's address (0.0.0.0:9808: every interface); empty: off")
			fs.String(&f.resultSer, "result-serializer", "NAME", "json", "serializer of the results sent to callers, as Celery's result_serializer: json, msgpack or yaml (the callers' result_accept_content must take it)")
			fs.Secret(&f.resultBE, "result-backend", "URL", "rpc://", "where results go, as Celery's result_backend (the URL the callers use): rpc:// (each caller's reply queue), redis://[:password@]host[:port][/db], rediss://... (TLS), redis+socket:///path (Celery's Redis backend) or django-db+postgresql://user:password@host/db (django-celery-results' tables)")
			fs.Duration(&f.resultExp, "result-expires", tasks.DefaultResultExpires, "how long the Redis backend keeps a result, as Celery's result_expires; 0 keeps it until deleted")
			fs.Bool(&f.resultExt, "result-extended", "store the task's name, args, kwargs, worker, retries and queue with its result, as Celery's result_extended")
			fs.Bool(&f.trackStarted, "track-started", "report STARTED to the caller when a task starts running, as Celery's task_track_started")
			f.defineLog(fs)
			fs.Bool(&f.logArguments, "log-arguments", "include task arguments (argsrepr, kwargsrepr) in logs; they may hold secrets")
			fs.Bool(&f.noRecord, "no-record", "run every task WITHOUT the idempotency record, to show what goes wrong: duplicates repeat their effects")
			fs.Bool(&f.migrate, "migrate", "apply the record schema and create the binary's own tables at start (as 'onceler migrate')")
			return func(ctx context.Context, args []string) error {
				if len(args) > 0 {
					return usagef("worker", "unexpected argument %q", args[0])
				}
				fs.fs.Visit(func(fl *flag.Flag) { f.queuesSet = f.queuesSet || fl.Name == "queues" })
				return a.runWorker(ctx, f)
			}
		},
	}
}

func (a *app) runWorker(ctx context.Context, f *workerFlags) error {
	logger, err := newLogger("worker", f.logLevel, f.logFormat, a.stderr)
	if err != nil {
		return err
	}
	defer func() { _ = logger.Sync() }()
	var queues []amqp.QueueSpec
	var skCfg *sidekiq.Config
	if f.sidekiqURL != "" {
		if skCfg, err = f.sidekiqConfig(); err != nil {
			return err
		}
	} else if queues, err = f.queueSpecs(); err != nil {
		return err
	}
	switch {
	case f.concurrency < 0:
		return usagef("worker", "--concurrency must not be negative")
	case f.prefetch < 0:
		return usagef("worker", "--prefetch must not be negative")
	case f.lease <= 0:
		return usagef("worker", "--lease must be positive")
	case f.grace <= 0:
		return usagef("worker", "--grace must be positive")
	case f.groupTx < 0 || f.groupTx > 32:
		return usagef("worker", "--group-tx must be between 0 and 32")
	case f.flushers < 0 || f.flushers > 16:
		return usagef("worker", "--flushers must be between 0 and 16")
	case f.stallAfter <= 0:
		return usagef("worker", "--stall-after must be positive")
	}
	budget := tasks.DefaultMemoryBudget()
	if f.memBudget != "" {
		if budget, err = parseSize(f.memBudget); err != nil {
			return usagef("worker", "invalid --memory-budget %q: %v", f.memBudget, err)
		}
		if budget < 16<<20 {
			return usagef("worker", "--memory-budget must be at least 16MiB")
		}
	}
	if a.user.Register == nil {
		return usagef("worker", "no tasks to serve: this binary's cmd.App has no Register function")
	}
	crash := workerhooks.CrashFromEnv(a.getenv)
	if crash.Validate() != nil {
		return usagef("worker", "invalid ONCELER_CRASH_AT=%q: use %s, %s, %s or %s", crash.At,
			workerhooks.AfterClaim, workerhooks.AfterEffect, workerhooks.BeforeAck, workerhooks.ChordJoined)
	}
	node, err := control.NodeName(f.hostname)
	if err != nil {
		return usagef("worker", "invalid --hostname %q: %v", f.hostname, err)
	}
	if !slices.Contains(celeryproto.Serializers, f.resultSer) {
		return usagef("worker", "invalid --result-serializer %q: use %s", f.resultSer, strings.Join(celeryproto.Serializers, ", "))
	}
	if err := tasks.CheckResultBackend(f.resultBE); err != nil {
		return usagef("worker", "invalid --result-backend: %v", err)
	}
	if f.resultExp < 0 {
		return usagef("worker", "--result-expires must not be negative")
	}
	if f.httpAddr != "" {
		addr, err := httpListenAddr(f.httpAddr)
		if err != nil {
			return usagef("worker", "invalid --http-addr %q: %v (use a port, :port or host:port)", f.httpAddr, err)
		}
		f.httpAddr = addr
	}
	broker := f.broker.config(node)
	broker.MaxBackoff = 0
	broker.Logger = logger

	pool, store, err := openStore(ctx, "worker", f.db, logger, idempotency.BatchConfig{GroupTx: f.groupTx, Flushers: f.flushers})
	if err != nil {
		return err
	}
	defer pool.Close()
	defer store.Close()
	var found []amqp.QueueSpec
	if skCfg == nil {
		if found, err = probeBroker(ctx, broker, queues); err != nil {
			return err
		}
	}
	concurrency, prefetch := f.concurrency, f.prefetch
	if concurrency <= 0 {
		concurrency = tasks.DefaultConcurrency()
	}
	if prefetch <= 0 {
		prefetch = tasks.DefaultPrefetch(concurrency)
		if pq := priorityQueues(found); len(pq) > 0 {
			prefetch = concurrency
			logger.Info("priority queue: the prefetch defaults to the concurrency, so that the tasks waiting for a slot stay in the broker, where priorities apply",
				zap.Strings("priority_queues", pq), zap.Int("prefetch", prefetch))
		}
	}
	if f.migrate {
		if err := a.migrate(ctx, pool, store, f.db.schema); err != nil {
			return err
		}
	}
	if !f.noRecord {
		if err := a.checkPrivileges(ctx, "worker", store, f.db.schema, idempotency.WorkerPrivileges(), "--grant-to"); err != nil {
			return err
		}
		if err := checkSchema(ctx, a.prog, store, f.db.schema); err != nil {
			return err
		}
	}

	reg := tasks.NewRegistry()
	if err := callUser("Register", func() error { return a.user.Register(ctx, reg, Env{Pool: pool, Logger: logger}) }); err != nil {
		return fmt.Errorf("register the tasks: %w", err)
	}
	if len(reg.Names()) == 0 {
		return errors.New("no tasks to serve: Register added none to the registry")
	}

	if crash.At != "" {
		task := crash.Task
		if task == "" {
			task = "(any task)"
		}
		logger.Warn("crash injection armed: the process will kill itself", zap.String("at", crash.At), zap.String("task", task))
	}
	if f.noRecord {
		logger.Warn("!!! --no-record: running every task WITHOUT the idempotency record; duplicate and redelivered messages WILL repeat their effects. Never do this in production. !!!")
	}

	metrics := prometheus.NewRegistry()
	metrics.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	cfg := tasks.Config{
		Sidekiq:          skCfg,
		Broker:           broker,
		Queues:           queues,
		Pool:             pool,
		Store:            store,
		Concurrency:      concurrency,
		Prefetch:         prefetch,
		Lease:            f.lease,
		Grace:            f.grace,
		Hostname:         node,
		Program:          a.prog,
		Logger:           logger,
		Metrics:          metrics,
		LogArguments:     f.logArguments,
		NoControl:        f.noControl,
		TaskEvents:       f.events,
		ResultSerializer: f.resultSer,
		MemoryBudget:     budget,
		StallAfter:       f.stallAfter,
		ResultBackend:    f.resultBE,
		ResultExpires:    resultExpires(f.resultExp),
		ResultExtended:   f.resultExt,
		TrackStarted:     f.trackStarted,
	}
	workerhooks.Set(&cfg, workerhooks.Hooks{NoRecord: f.noRecord, Crash: crash})
	w, err := tasks.NewWorker(reg, cfg)
	if err != nil {
		return fmt.Errorf("worker: %w", err)
	}
	gogc := workerGCPercent()
	memLimit := workerMemoryLimit(budget)
	source := zap.String("broker", amqp.RedactURL(f.broker.url))
	if skCfg != nil {
		source = zap.String("sidekiq", sidekiq.RedactURL(skCfg.URL))
	}
	logger.Info("starting worker", zap.String("node", node), source, zap.String("schema", f.db.schema), zap.Int("gogc", gogc),
		zap.Int64("memory_budget", budget), zap.Int64("go_memory_limit", memLimit),
		zap.String("result_backend", tasks.RedactResultBackend(f.resultBE)),
		zap.Strings("queues", strings.Split(f.queues, ",")))

	var wg sync.WaitGroup
	defer wg.Wait()
	httpCtx, stopHTTP := context.WithCancel(ctx)
	defer stopHTTP()
	if f.httpAddr != "" {
		ln, err := net.Listen("tcp", f.httpAddr)
		if err != nil {
			return fmt.Errorf("listen on --http-addr %s: %s", f.httpAddr, oneLine(err))
		}
		logger.Info("serving /metrics, /healthz and /readyz", zap.String("addr", ln.Addr().String()))
		wg.Add(1)
		go func() {
			defer wg.Done()
			serveHTTP(httpCtx, ln, metrics, w.Ready, logger)
		}()
	}
	// The worker runs its remote control (unless --no-control) until its
	// tasks are done; a shutdown command ends Run as a signal does.
	err = w.Run(ctx)
	stopHTTP()
	var ae *amqp.AccessError
	if errors.As(err, &ae) {
		return accessError(ae)
	}
	if err != nil {
		return fmt.Errorf("worker stopped: %w", err)
	}
	return nil
}

// sidekiqConfig is the Sidekiq configuration of --sidekiq, --queues
// (Sidekiq's: a number after a name is its weight) and --sidekiq-heartbeat.
func (f *workerFlags) sidekiqConfig() (*sidekiq.Config, error) {
	if len(f.queueArgs) > 0 || f.quorum {
		return nil, usagef("worker", "--queue-arg and --quorum are RabbitMQ's: not with --sidekiq")
	}
	if f.noControl || f.events {
		return nil, usagef("worker", "--events and --no-control are Celery's: with --sidekiq there is no remote control nor events")
	}
	if f.sidekiqBeat < 500*time.Millisecond {
		return nil, usagef("worker", "--sidekiq-heartbeat must be at least 500ms")
	}
	spec := f.queues
	if !f.queuesSet {
		spec = "default"
	}
	qs, err := sidekiqQueues(spec)
	if err != nil {
		return nil, usagef("worker", "invalid --queues %q: %v", spec, err)
	}
	f.queues = spec
	return &sidekiq.Config{URL: f.sidekiqURL, Queues: qs, Heartbeat: f.sidekiqBeat, HeartbeatTTL: 12 * f.sidekiqBeat}, nil
}

// sidekiqQueues reads a --queues list for Sidekiq: names, each followed
// by its weight or not ("critical,2,default,1"), as sidekiq.Config.Queues
// takes them ("critical,2", "default,1").
func sidekiqQueues(spec string) ([]string, error) {
	var out []string
	for _, item := range strings.Split(spec, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		if w, err := strconv.Atoi(item); err == nil {
			if len(out) == 0 || strings.Contains(out[len(out)-1], ",") {
				return nil, fmt.Errorf("weight %s follows no queue name", item)
			}
			if w < 0 || w > sidekiq.MaxQueueWeight {
				return nil, fmt.Errorf("weight %s of queue %s: not between 0 and %d", item, out[len(out)-1], sidekiq.MaxQueueWeight)
			}
			out[len(out)-1] += "," + item
			continue
		}
		out = append(out, item)
	}
	if len(out) == 0 {
		return nil, errors.New("no queue")
	}
	return out, nil
}

// httpListenAddr is the address --http-addr listens on: a port alone
// ("9808") or without a host (":9808") is on the loopback interface
// (127.0.0.1); a host given ("0.0.0.0:9808", "[::]:9808", "10.0.0.5:9808")
// is used as it is.
func httpListenAddr(s string) (string, error) {
	if _, err := strconv.ParseUint(s, 10, 16); err == nil {
		s = ":" + s
	}
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		return "", err
	}
	if port == "" {
		return "", errors.New("no port")
	}
	if _, err := net.LookupPort("tcp", port); err != nil {
		return "", err
	}
	if host == "" {
		host = "127.0.0.1"
	}
	return net.JoinHostPort(host, port), nil
}

// serveHTTP serves metrics and health until ctx is done: those three
// paths on a mux of their own (nothing registered on
// http.DefaultServeMux, such as net/http/pprof's handlers, is served);
// any other path is 404.
func serveHTTP(ctx context.Context, ln net.Listener, metrics *prometheus.Registry, ready func() bool, logger *zap.Logger) {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(metrics, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if !ready() {
			http.Error(w, "not ready: not consuming, the database does not answer, or stalled (every slot held without progress)", http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ready\n"))
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			logger.Error("http server stopped", zap.Error(err))
		}
	}()
	<-ctx.Done()
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	_ = srv.Shutdown(sctx)
	<-done
}

func isPrecondition(err error) bool {
	var pe *amqp.PreconditionError
	return errors.As(err, &pe)
}

// workerGOGC is the garbage collector's target the worker runs with when
// the GOGC environment variable is unset: the worker's heap is small (tens
// of MiB at a prefetch of 256) and mostly short-lived per-message garbage,
// so collecting at 4× the live heap instead of 2× cuts its CPU per task by
// about a quarter for a few MiB more resident memory (docs/performance.md).
const workerGOGC = 400

// workerGCPercent applies workerGOGC unless GOGC is set, and returns the
// percentage in effect (-1: off).
func workerGCPercent() int {
	if _, ok := os.LookupEnv("GOGC"); ok {
		p := debug.SetGCPercent(-1) // read it back
		debug.SetGCPercent(p)
		return p
	}
	debug.SetGCPercent(workerGOGC)
	return workerGOGC
}

// resultExpires is tasks.Config.ResultExpires of --result-expires: 0 (keep
// until deleted) is a negative duration there, whose zero is the default.
func resultExpires(d time.Duration) time.Duration {
	if d == 0 {
		return -1
	}
	return d
}

// checkSchema refuses a record schema that is missing or older than the
// binary, in one line naming the command that applies it.
func checkSchema(ctx context.Context, prog string, store *idempotency.Store, schema string) error {
	cctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	err := store.CheckSchema(cctx)
	var se *idempotency.SchemaError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &se) && se.Have == 0:
		return fmt.Errorf("the record schema %q does not exist: run '%s migrate' (same --database-url and --schema) or start the worker with --migrate", schema, prog)
	case errors.As(err, &se):
		return fmt.Errorf("the record schema %q is at version %d, this binary needs %d: run '%s migrate' (same --database-url and --schema) or start the worker with --migrate", schema, se.Have, se.Want, prog)
	default:
		return fmt.Errorf("check the record schema %q: %s", schema, oneLine(err))
	}
}
