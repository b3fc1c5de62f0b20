// Command bench measures onceler's drain throughput against the broker's
// ceiling and a Python Celery worker doing the same record keeping, on the
// same RabbitMQ and PostgreSQL, in one run:
//
//	go run ./integration/bench            # N = 50,000
//	go run ./integration/bench -quick     # a small smoke run
//
// For each scenario it pre-fills a fresh queue with N protocol 2 JSON task
// messages in the format Celery 5.2.6 producers send (publisher confirms),
// starts the consumer in a child process and measures how fast it drains:
//
//	(a)  a raw consume-and-ack loop (the ceiling), same prefetch
//	(b)  the onceler worker, outside-system no-op task: claim, then completion; ignore_result
//	(b') the same with a same-database task that inserts one row
//	(c)  (b) with results published to reply_to
//	(c-redis) (b) with results written to Redis (-redis, Celery's Redis result backend)
//	(d)  (b) with 20% duplicate deliveries
//	(e)  a Python Celery 5.2.6 prefork worker (concurrency = cores, acks_late)
//	     doing the same claim and completion with psycopg2
//	(s-raw) N Sidekiq jobs in a queue of the -redis database, drained by a raw
//	     LMOVE-to-a-working-list and LREM loop (the ceiling of a reliable fetch)
//	(s)  the same jobs drained by the onceler worker with tasks.Config.Sidekiq
//	     (onceler worker --sidekiq): (b)'s no-op task, claim and completion
//	(sqs-raw) N Celery messages (kombu's SQS envelope) in a queue of the -sqs
//	     server, drained by a raw loop of batched receives and deletes
//	(sqs) the same messages drained by the onceler worker with
//	     tasks.Config.SQS (onceler worker --sqs): (b)'s no-op task
//
// Then it publishes at half of each worker scenario's measured rate and
// reports the end-to-end latency. It prints a markdown table: tasks/s,
// ratios to (a) and (e), p50/p99 latency, the worker's peak RSS (VmHWM of
// the child process) and PostgreSQL commits per task (xact_commit of the
// bench's own database).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"runtime"
	"strings"
	"syscall"
	"time"

	"github.com/onceler/onceler/tasks"
)

type options struct {
	n, pyN        int
	prefetch      int
	concurrency   int
	poolConns     int
	flushers      int
	linger        time.Duration
	groupTx       int
	workerGOGC    int
	workerProcs   int
	procs         int
	amqpURL       string
	dbURL         string
	python        string
	quick         bool
	only          string
	pairs         int
	pairN         int
	monitor       string
	latencyDump   string
	latencySecs   float64
	latencyWarmup float64
	latencyRate   float64
	cpuProfile    string
	profiled      string
	memProfile    string
	timeout       time.Duration
	debug         bool
	redisURL      string
	sqsEndpoint   string
}

func main() {
	if os.Getenv(childEnv) != "" {
		if err := childMain(); err != nil {
			fmt.Fprintln(os.Stderr, "bench child:", err)
			os.Exit(1)
		}
		return
	}
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func run() error {
	var o options
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.IntVar(&o.n, "n", 50000, "messages per drain scenario")
	fs.IntVar(&o.pyN, "python-n", 10000, "messages for the Python worker (e); 0 = same as -n")
	fs.IntVar(&o.prefetch, "prefetch", 0, "prefetch of the onceler worker (0: its default, tasks.DefaultPrefetch) and of the raw consumer (0: the worker's default prefetch)")
	fs.IntVar(&o.concurrency, "concurrency", 0, "task goroutines of the onceler worker (0: its default, tasks.DefaultConcurrency)")
	fs.IntVar(&o.poolConns, "pool", 0, "PostgreSQL pool size of the onceler worker (0: the onceler command's, tasks.DefaultPoolConns)")
	fs.IntVar(&o.flushers, "flushers", 0, "record flushes of the onceler worker running at once (onceler worker --flushers; 0: the store's default, 1)")
	fs.DurationVar(&o.linger, "linger", 0, "how long a flush of the worker's record waits for calls on their way (BatchConfig.Linger; 0: the store's default, negative: none)")
	fs.IntVar(&o.workerProcs, "worker-procs", 0, "GOMAXPROCS of the consumer processes (0: the runtime's default, the number of CPUs)")
	fs.IntVar(&o.procs, "procs", 1, "GOMAXPROCS of the bench's own process, the load generator (publisher, events monitor, reply reader): one keeps its idle scheduler from spinning on the cores the measured processes share; 0: the runtime's default")
	fs.IntVar(&o.workerGOGC, "worker-gogc", 400, "GOGC of the worker process: 400 is the onceler worker's own when GOGC is unset; 100 is Go's default")
	fs.IntVar(&o.groupTx, "group-tx", 0, "same-database transaction groups of the worker's record, as onceler worker --group-tx (0: adaptive, the default; 1: a transaction each; N: groups of up to N)")
	fs.StringVar(&o.amqpURL, "amqp", envOr("ONCELER_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"), "RabbitMQ URL")
	fs.StringVar(&o.dbURL, "db", envOr("ONCELER_BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/onceler_bench?sslmode=disable"),
		"PostgreSQL URL of a database used by the bench alone (created when missing)")
	fs.StringVar(&o.python, "python", "/usr/bin/python3", "Python with Celery 5.2.6 and psycopg2, for (e)")
	fs.BoolVar(&o.quick, "quick", false, "small smoke run: N = 2000, Python N = 500, 1 s latency runs")
	fs.StringVar(&o.only, "scenarios", "a,b,b',b'-tx,b'-hot,c,c-redis,d,e,f,s-raw,s,sqs-raw,sqs", "scenarios to run, comma-separated")
	fs.StringVar(&o.redisURL, "redis", envOr("ONCELER_BENCH_REDIS_URL", "redis://127.0.0.1:6379/9"), "Redis result backend of (c-redis), and the Redis of the Sidekiq scenarios (s-raw) and (s); their results and jobs are deleted after the run")
	fs.StringVar(&o.sqsEndpoint, "sqs", envOr("ONCELER_BENCH_SQS_ENDPOINT", "http://127.0.0.1:4100"), "SQS server of (sqs-raw) and (sqs) (goaws, started by .ci/setup); their queues are deleted after the run")
	fs.IntVar(&o.pairs, "pairs", 9, "rounds of (f), each next to a run of (b) without events; the median ratio is reported")
	fs.StringVar(&o.monitor, "monitor", monitorAfter, "how (f)'s events monitor reads them: "+monitorAfter+" (its queue bound during the run, read once the worker is done, as by a monitor on another machine), "+
		monitorLive+" (consumed during the run, on the same cores), "+monitorNone+" (no queue: the broker drops them, as when no Flower is connected)")
	fs.IntVar(&o.pairN, "pair-n", 20000, "messages per run of (f) and of its (b) twin (0: -n); shorter runs, more rounds")
	fs.Float64Var(&o.latencySecs, "latency-seconds", 5, "duration of each steady-load latency run (0: none)")
	fs.Float64Var(&o.latencyWarmup, "latency-warmup", 2, "seconds of the same load before each latency run's measured messages (a fresh worker's first seconds)")
	fs.StringVar(&o.latencyDump, "latency-dump", "", "write each latency run's per-message send time, latency and (worker scenarios without results) the times of task-received and task-started to PREFIX.<scenario>.csv")
	fs.Float64Var(&o.latencyRate, "latency-rate", 0, "publish rate of the latency runs (0: half of each scenario's sustained rate, found by short runs first)")
	fs.StringVar(&o.cpuProfile, "cpuprofile", "", "write the CPU profile of the worker in the -profile scenario to this file")
	fs.StringVar(&o.memProfile, "memprofile", "", "write the allocation profile of the worker in the -profile scenario to this file")
	fs.StringVar(&o.profiled, "profile", "b", "the scenario whose worker -cpuprofile and -memprofile profile (for (f): its first round; b-latency: (b)'s latency run)")
	fs.DurationVar(&o.timeout, "timeout", 5*time.Minute, "limit of one scenario")
	fs.BoolVar(&o.debug, "debug", false, "log the worker's debug output to stderr")
	if err := fs.Parse(os.Args[1:]); err != nil {
		return err
	}
	if o.procs > 0 {
		runtime.GOMAXPROCS(o.procs)
	}
	if o.quick {
		o.n, o.pyN, o.latencySecs, o.latencyWarmup, o.pairs, o.pairN = 2000, 500, 1, 0.5, 1, 2000
	}
	if o.pyN <= 0 {
		o.pyN = o.n
	}
	if o.pairN <= 0 {
		o.pairN = o.n
	}
	switch o.monitor {
	case monitorAfter, monitorLive, monitorNone:
	default:
		return fmt.Errorf("-monitor %q: want %s, %s or %s", o.monitor, monitorAfter, monitorLive, monitorNone)
	}
	if o.n < 2 {
		return fmt.Errorf("-n must be at least 2")
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	b, err := newBench(ctx, o)
	if err != nil {
		return err
	}
	defer b.close()
	rows, err := b.runAll(ctx, strings.Split(o.only, ","))
	fmt.Println()
	fmt.Print(report(o, rows))
	return err
}

// workerSettings describes the worker's settings: its defaults unless
// flags tuned them.
func (o options) workerSettings() string {
	c, pool := o.concurrency, o.poolConns
	if c <= 0 {
		c = tasks.DefaultConcurrency()
	}
	if pool <= 0 {
		pool = tasks.DefaultPoolConns
	}
	group := "adaptive transaction groups"
	switch {
	case o.groupTx == 1:
		group = "no transaction groups"
	case o.groupTx > 1:
		group = fmt.Sprintf("transaction groups of %d", o.groupTx)
	}
	s := fmt.Sprintf("concurrency %d, prefetch %d, pool %d connections, %s", c, o.rawPrefetch(), pool, group)
	if o.concurrency > 0 || o.prefetch > 0 || o.poolConns > 0 || o.groupTx > 0 || o.flushers > 0 || o.linger != 0 {
		return "TUNED: " + s
	}
	return "at its defaults: " + s
}

// rawPrefetch is the prefetch of the raw consumer (a): the worker's.
func (o options) rawPrefetch() int {
	if o.prefetch > 0 {
		return o.prefetch
	}
	c := o.concurrency
	if c <= 0 {
		c = tasks.DefaultConcurrency()
	}
	return tasks.DefaultPrefetch(c)
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// machine describes where the numbers come from: the CPUs, the GOMAXPROCS
// of the consumers (workerProcs, 0: one per CPU) and of the bench itself.
func machine(workerProcs int) string {
	if workerProcs <= 0 {
		workerProcs = runtime.NumCPU()
	}
	return fmt.Sprintf("%d CPUs (GOMAXPROCS %d for the consumers, %d for the bench's own process), %s/%s, %s", runtime.NumCPU(),
		workerProcs, runtime.GOMAXPROCS(0), runtime.GOOS, runtime.GOARCH, runtime.Version())
}
