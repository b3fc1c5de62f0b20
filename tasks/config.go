package tasks

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/control"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/logging"
	"github.com/onceler/onceler/internal/workerhooks"
	"github.com/onceler/onceler/sidekiq"
	"github.com/onceler/onceler/sqs"
)

// Config configures a Worker. Zero values take the documented defaults.
type Config struct {
	// Broker is the RabbitMQ connection configuration. The worker opens one
	// connection for consuming and one for publishing (results, quarantine),
	// and one for the remote control. A failover list (Broker.URLs, or URL
	// with ';') serves all three: each moves on to the next URL on its own.
	Broker amqp.Config
	// Queues are the queues consumed. Default: amqp.CeleryQueue("celery").
	// A queue that exists is consumed as it is, with the arguments its
	// declarer gave it; a missing one is declared with the spec's (see
	// "Queues" in package amqp). Each queue q gets a durable quarantine
	// queue "q.quarantine", declared by the worker.
	Queues []amqp.QueueSpec

	// Sidekiq, when set, makes the worker consume Sidekiq jobs from Redis
	// instead of Celery messages from RabbitMQ (docs/sidekiq.md): its URL
	// and Queues are required; its Concurrency defaults to Concurrency and
	// its Logger to Logger. Broker and Queues are then not used; there is
	// no remote control nor worker events (NoControl is implied: they are
	// Celery's), and a job is answered by its outcome in Redis (Sidekiq's
	// retry and dead sets) and the record, not by a result to a caller.
	Sidekiq *sidekiq.Config

	// SQS, when set, makes the worker consume Amazon SQS queues instead of
	// RabbitMQ (docs/sqs.md): Celery messages as kombu's SQS transport
	// writes them and plain messages (the body the task's arguments as
	// JSON, the task a message attribute or the queue's). Its Queues are
	// required. Broker and Queues are then not used; there is no remote
	// control nor worker events (NoControl is implied), and results go to
	// the result backend (ResultBackend; rpc:// does not exist over SQS, as
	// in Celery: without a backend no result is kept).
	SQS *sqs.Config

	// Pool is the PostgreSQL pool of the record (and of same-database
	// effects). Required unless every task is pure.
	Pool *pgxpool.Pool
	// Store is the idempotency record. Default: idempotency.New(Pool, ...)
	// with the default schema, opened and closed by the worker. The schema
	// must be migrated (Store.Migrate) before Run.
	Store *idempotency.Store

	// Concurrency is the number of task goroutines. Default
	// DefaultConcurrency(): 64 × GOMAXPROCS, at least 256. Goroutines are
	// cheap, and most tasks wait (for the record, the database, a reply):
	// many in flight fill the record's batches and transaction groups,
	// which is where the throughput comes from.
	Concurrency int
	// Prefetch is the broker's prefetch window (unacknowledged deliveries).
	// Default DefaultPrefetch(Concurrency): 4 × Concurrency up to 256, never
	// below Concurrency. A priority queue (x-max-priority) orders the
	// messages still in the queue, not those already delivered, and the
	// worker runs deliveries in the order they arrive: a delivery waiting
	// for a task slot is not overtaken by one of higher priority that
	// arrives after it. Prefetch equal to Concurrency keeps every waiting
	// task in the broker, where priorities apply (the onceler worker
	// command defaults to it when it consumes a priority queue).
	Prefetch int
	// Lease is the claim lease of tasks that do not set one. Default 30 s.
	Lease time.Duration
	// Grace is how long running tasks may take to finish after Run's context
	// is cancelled before their contexts are cancelled. Default 30 s.
	Grace time.Duration
	// MaxHold is the longest a delivery is held unacknowledged for its ETA:
	// a delivery due later is republished (a copy with a confirm, to the
	// queue it came from) and acknowledged after MaxHold, and the copy is
	// held in its place, so that no delivery stays unacknowledged past
	// RabbitMQ's consumer_timeout (which would close the channel). Default
	// 25 minutes (consumer_timeout defaults to 30); negative: never.
	MaxHold time.Duration
	// MemoryBudget bounds, in bytes, the memory of the deliveries the
	// worker holds: being decoded, waiting, running and held for their ETA
	// (see docs/limits.md). Each delivery is charged what its decoding may
	// take before it is decoded, then what its decoded message takes; past
	// the budget the worker takes no more deliveries (it caps the prefetch
	// window) until memory is released. It also sets the per-message
	// limits: a body at most an eighth of it (and 16 MiB), its decoded
	// values at most a quarter (and 64 MiB); a delivery whose decoding
	// would need more than the whole budget is quarantined undecoded.
	// Deliveries held for their ETA take at most half. Default
	// DefaultMemoryBudget(): a quarter of the cgroup's or the machine's
	// memory, from 64 MiB to 2 GiB.
	MemoryBudget int64
	// StallAfter is how long the worker may hold every slot without
	// settling any delivery before Ready reports it not ready: every task
	// goroutine busy, or the prefetch window full of deliveries not held
	// for their ETA, or deliveries waiting for memory. Default 1 minute.
	StallAfter time.Duration
	// Hostname is the node name, "name@host": the record's claim owner, the
	// worker of stored results and events, the name remote control answers
	// to. Default: control.NodeName's default, "onceler-<pid>@<host>",
	// unique per process (the onceler command's default).
	Hostname string
	// Program is the name of the binary's command in the messages that
	// tell a person which of its subcommands to run ("resolve it with
	// 'onceler resolve'"). Default "onceler".
	Program string
	// Logger receives structured logs. Default: info and above to standard
	// error in the onceler command's console format; zap.NewNop() for none.
	Logger *zap.Logger
	// Metrics registers the worker's Prometheus collectors. Default: not
	// registered (the collectors still count).
	Metrics prometheus.Registerer

	// RevokedExpiry is how long a revoked task id (Worker.Revoke) is
	// remembered, as Celery's REVOKE_EXPIRES. Default 3 h; the set also keeps
	// at most the last 50,000 ids.
	RevokedExpiry time.Duration
	// MaxAttempts bounds how often one message may be delivered (quorum
	// queues: x-delivery-count) or one operation claimed by redeliveries (the
	// record's attempt count; same-database tasks: redeliveries counted with
	// idempotency CountAttempt) before the message is quarantined as poison.
	// Default 5. On the last delivery a quorum queue's x-delivery-limit
	// allows, the message is republished with its deliveries so far
	// (HeaderDeliveries), which count with the copy's against MaxAttempts.
	MaxAttempts int
	// Observer receives task events (task-received, task-started, ...),
	// besides the worker's remote control when task events are on. It must
	// not be a *control.Controller unless NoControl is set (the worker runs
	// one of its own).
	Observer Observer
	// NoControl turns off the worker's remote control: by default the
	// worker runs a control.Controller of its own on a connection to Broker,
	// which answers Celery's remote control ('celery inspect', 'celery
	// control', a shutdown command ends Run as its context would) and sends
	// worker events (worker-online, worker-heartbeat every 2 s,
	// worker-offline once Run's tasks are done) as a Celery worker does, for
	// 'celery events' and Flower. To run a Controller configured otherwise,
	// set NoControl and give it the worker (control.New) and make it the
	// Observer.
	NoControl bool
	// TaskEvents sends task events (task-received, task-started,
	// task-succeeded, ...) through the remote control from the start, as
	// Celery's -E; the enable_events and disable_events commands switch them
	// at run time. Off by default.
	TaskEvents bool
	// Routes maps task names to the queue their workflow steps (chain steps,
	// link callbacks, errbacks) are published to when the step's signature
	// names no queue, exchange or routing key, as Celery's task_routes.
	// Unlisted tasks go to the queue of the delivery that publishes them
	// when this worker serves them, else to Celery's default queue "celery".
	Routes map[string]string
	// ResultSerializer is the serializer of the results sent to callers:
	// "json" (the default), "msgpack" or "yaml", as Celery's
	// result_serializer; the callers' result_accept_content must take it.
	ResultSerializer string
	// ResultBackend is where results go, as Celery's result_backend: the
	// URL the callers use. "" or "rpc://" (the default): to each caller's
	// reply queue. "redis://[[user]:password@]host[:port][/db]",
	// "rediss://..." (TLS) or "redis+socket:///path": the celery-task-meta-
	// keys of Celery's Redis backend. Other schemes are refused by
	// NewWorker (see BackendSchemes).
	ResultBackend string
	// ResultExpires is how long a result is kept by a backend that expires
	// them (Redis), as Celery's result_expires. Default 1 day; negative:
	// kept until deleted.
	ResultExpires time.Duration
	// ResultExtended stores the request beside the result (name, args,
	// kwargs, worker, retries, queue), as Celery's result_extended.
	ResultExtended bool
	// TrackStarted reports STARTED (result {"pid", "hostname"}) when a task
	// starts running, as Celery's task_track_started: a worker setting
	// (Celery's messages do not carry it). One attempt: a write that fails
	// is logged and the task runs anyway.
	TrackStarted bool
	// LogArguments adds argsrepr/kwargsrepr to logs. Off by default:
	// arguments may carry secrets.
	LogArguments bool

	// hooks are the settings of internal/workerhooks (crash injection,
	// running without the record), set only through workerhooks.Set.
	hooks workerhooks.Hooks
}

func init() {
	// The settings that are no part of this package's API reach a Config
	// through internal/workerhooks only.
	workerhooks.Install(func(c *Config, h workerhooks.Hooks) { c.hooks = h })
}

// DefaultConcurrency is Config.Concurrency's default: 64 × GOMAXPROCS, at
// least 256.
func DefaultConcurrency() int { return max(256, 64*runtime.GOMAXPROCS(0)) }

// DefaultPrefetch is Config.Prefetch's default for a concurrency: 4 × it,
// at most 256 (more only holds deliveries in memory longer), but never
// below the concurrency (every task goroutine can have a delivery).
func DefaultPrefetch(concurrency int) int { return max(concurrency, min(256, 4*concurrency)) }

// DefaultPoolConns is the size of the PostgreSQL pool the onceler command
// opens for its worker (unless the database URL sets pool_max_conns), and
// the size this package suggests for Config.Pool: the record's batches
// take one or two connections, same-database tasks one each while they
// run alone, and a pool this size keeps them from waiting for one another
// without loading the server with backends.
const DefaultPoolConns = 16

func (c *Config) setDefaults() error {
	if c.SQS != nil {
		if c.Sidekiq != nil {
			return errors.New("tasks: Config.SQS and Config.Sidekiq exclude each other")
		}
		if len(c.SQS.Queues) == 0 {
			return errors.New("tasks: Config.SQS needs its Queues")
		}
		c.NoControl = true
	}
	if c.Sidekiq != nil {
		if c.Sidekiq.URL == "" || len(c.Sidekiq.Queues) == 0 {
			return errors.New("tasks: Config.Sidekiq needs its URL and Queues")
		}
		c.NoControl = true
	}
	if len(c.Queues) == 0 {
		c.Queues = []amqp.QueueSpec{amqp.CeleryQueue("celery")}
	}
	for _, q := range c.Queues {
		if q.Name == "" {
			return errors.New("tasks: queue without a name")
		}
	}
	if c.Concurrency <= 0 {
		c.Concurrency = DefaultConcurrency()
	}
	if c.Prefetch <= 0 {
		c.Prefetch = DefaultPrefetch(c.Concurrency)
	}
	if c.Lease <= 0 {
		c.Lease = 30 * time.Second
	}
	if c.Grace <= 0 {
		c.Grace = 30 * time.Second
	}
	if c.MemoryBudget <= 0 {
		c.MemoryBudget = DefaultMemoryBudget()
	}
	if c.StallAfter <= 0 {
		c.StallAfter = time.Minute
	}
	if c.MaxHold == 0 {
		c.MaxHold = 25 * time.Minute
	}
	if c.Hostname == "" {
		name, err := control.NodeName("")
		if err != nil {
			return fmt.Errorf("tasks: default node name: %w", err)
		}
		c.Hostname = name
	}
	if c.Logger == nil {
		c.Logger = logging.Default()
	}
	if c.Program == "" {
		c.Program = "onceler"
	}
	if c.RevokedExpiry <= 0 {
		c.RevokedExpiry = 3 * time.Hour
	}
	if c.MaxAttempts <= 0 {
		c.MaxAttempts = 5
	}
	if c.ResultSerializer == "" {
		c.ResultSerializer = "json"
	}
	if c.ResultExpires == 0 {
		c.ResultExpires = DefaultResultExpires
	}
	if !slices.Contains(celeryproto.Serializers, c.ResultSerializer) {
		return fmt.Errorf("tasks: result serializer %q: use %s", c.ResultSerializer, strings.Join(celeryproto.Serializers, ", "))
	}
	if err := c.hooks.Crash.Validate(); err != nil {
		return fmt.Errorf("tasks: %w", err)
	}
	return nil
}

// Observer receives the worker's task events with Celery's field names (see
// doc.go). Event must not block: it is called on the task path.
type Observer interface {
	Event(ctx context.Context, typ string, fields map[string]any)
}

// TaskEventObserver is an Observer that also takes task events as values
// (control.Controller is one): the worker then hands it each task event as a
// *celeryproto.TaskEvent, which it owns from then on, and builds no field
// map. TaskEvent must not block either.
type TaskEventObserver interface {
	Observer
	TaskEvent(ctx context.Context, e *celeryproto.TaskEvent)
}
