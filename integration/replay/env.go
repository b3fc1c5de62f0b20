package replay

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testkit"
)

// DefaultLease is the claim lease the suite gives its workers: short, so
// that crash scenarios finish fast.
const DefaultLease = 2 * time.Second

// Config describes the workers of an Env: which binary to start and how.
type Config struct {
	// Binary is the path of the worker binary (see Build).
	Binary string
	// Command is the arguments the binary gets, e.g. {"worker", "--migrate"}
	// for the onceler binary; settings come from the environment (see the
	// package documentation).
	Command []string
	// Env holds extra environment variables ("NAME=value") for every worker.
	Env []string
	// Lease is the claim lease (ONCELER_LEASE). Default DefaultLease.
	Lease time.Duration
	// AMQPURL is the broker. Default: ONCELER_TEST_AMQP_URL, else the local
	// broker amqp://guest:guest@127.0.0.1:5672/ when it answers; else the
	// test is skipped (it fails when ONCELER_REQUIRE_SERVICES=1).
	AMQPURL string
	// WorkerBrokerURL is the broker URL the workers get, when it is not
	// AMQPURL: the same broker and vhost as another user (one with only
	// the permissions a worker needs). Default AMQPURL.
	WorkerBrokerURL string
	// DatabaseURL is the PostgreSQL server of the record (and of the pool
	// handed to Effects). Default: ONCELER_TEST_DATABASE_URL, else the local
	// postgres://postgres@127.0.0.1:5432/test when it answers; else the test
	// is skipped (it fails when ONCELER_REQUIRE_SERVICES=1).
	DatabaseURL string
	// Quorum declares the queue a quorum queue (as kombu does with
	// queue_arguments={"x-queue-type": "quorum"}) and starts the workers
	// with ONCELER_QUORUM=true.
	Quorum bool
	// QueueArgs are further arguments the queue is declared with, as kombu's
	// Queue(queue_arguments=...) gives them (e.g. x-delivery-limit); the
	// workers find them on the queue.
	QueueArgs map[string]any
	// DurableReplies declares the reply queue durable, so that results
	// survive a broker restart (Celery's own reply queue does not).
	DurableReplies bool
	// ResultBackend is the workers' result backend (ONCELER_RESULT_BACKEND),
	// a redis:// URL; results are then read from Redis (Replies gives the
	// one stored result of a task id). Default: rpc://, the reply queue.
	ResultBackend string
	// WorkerDatabaseURL is the database URL the workers get
	// (ONCELER_DATABASE_URL), e.g. one naming a role with only a worker's
	// privileges, on the same database as DatabaseURL. The suite itself
	// (the schema's creation and migration, Pool, Store, Effects) keeps
	// DatabaseURL. Default: DatabaseURL.
	WorkerDatabaseURL string
	// Prepare runs once the record schema is migrated, before any worker
	// starts, with the suite's own pool (e.Pool): e.g. to grant the role of
	// WorkerDatabaseURL its privileges on e.Schema. Nil: nothing.
	Prepare func(ctx context.Context, e *Env) error
}

// Env is one test's isolated world: its own queue (and quarantine queue),
// its own record schema, a reply queue collecting every result, and the
// worker processes it started. Everything is removed when the test ends.
type Env struct {
	t   testing.TB
	cfg Config

	// AMQPURL and DatabaseURL are the services the workers use.
	AMQPURL, DatabaseURL string
	// Queue is the queue the workers consume; Quarantine its quarantine.
	Queue, Quarantine string
	// ReplyTo is the reply queue every published task names.
	ReplyTo string
	// Schema is the record's PostgreSQL schema.
	Schema string
	// Pool is a pool on the test database (for effect counts).
	Pool *pgxpool.Pool
	// Store reads the record in Schema.
	Store *idempotency.Store

	conn    *amqp091.Connection
	pubMu   sync.Mutex
	pub     *amqp091.Channel
	inspect *amqp091.Channel
	replyCh *amqp091.Channel
	wg      sync.WaitGroup // the reply collector

	redisOnce sync.Once
	redis     *redis.Client // results with Config.ResultBackend

	mu      sync.Mutex
	replies map[string][]Reply
	workers []*Worker
	seq     int
}

// Reply is one result a worker sent to the reply queue (Celery's rpc
// backend format).
type Reply struct {
	TaskID string
	// Status is SUCCESS, FAILURE, RETRY or REVOKED.
	Status string
	// Result is the result, or the exception object of a failure.
	Result json.RawMessage
	// ExcType is the exception type of a failure ("" on success).
	ExcType string
}

// NewEnv creates a queue, a reply queue and a migrated record schema for
// the test, all removed when it ends.
func NewEnv(t testing.TB, cfg Config) *Env {
	t.Helper()
	if cfg.Lease <= 0 {
		cfg.Lease = DefaultLease
	}
	e := &Env{
		t: t, cfg: cfg,
		AMQPURL: cfg.AMQPURL, DatabaseURL: cfg.DatabaseURL,
		Queue:   testkit.Name("replay"),
		replies: make(map[string][]Reply),
	}
	e.Quarantine = e.Queue + ".quarantine"
	if e.AMQPURL == "" {
		e.AMQPURL = testkit.Rabbit.URL(t)
	}
	if e.DatabaseURL == "" {
		e.DatabaseURL = testkit.Postgres.URL(t)
	}
	e.Pool, e.Schema = ownSchema(t, e.DatabaseURL)
	store, err := idempotency.New(e.Pool, idempotency.Config{Schema: e.Schema})
	if err != nil {
		t.Fatalf("open record: %v", err)
	}
	t.Cleanup(store.Close)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := store.Migrate(ctx); err != nil {
		t.Fatalf("migrate record: %v", err)
	}
	e.Store = store
	if cfg.Prepare != nil {
		if err := cfg.Prepare(ctx, e); err != nil {
			t.Fatalf("prepare: %v", err)
		}
	}
	e.ReplyTo = testkit.Name("replay_reply")
	t.Cleanup(e.close)
	if err := e.openBroker(); err != nil {
		t.Fatalf("broker: %v", err)
	}
	return e
}

// ownSchema opens a pool on url and a fresh schema in it, both gone when
// the test ends.
func ownSchema(t testing.TB, url string) (*pgxpool.Pool, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatalf("open pool: %v", err)
	}
	t.Cleanup(pool.Close)
	name := testkit.Name("t")
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatalf("create schema: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, _ = pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{name}.Sanitize()+" CASCADE")
	})
	return pool, name
}

// Reconnect opens the harness's broker connection again (after a broker
// restart or a close of all connections) and resumes collecting replies.
func (e *Env) Reconnect() error {
	e.pubMu.Lock()
	old := e.conn
	e.pubMu.Unlock()
	if old != nil {
		_ = old.Close()
	}
	e.wg.Wait()
	var err error
	ok := testkit.Eventually(60*time.Second, func() bool {
		err = e.openBroker()
		return err == nil
	})
	if !ok {
		return fmt.Errorf("reconnect to the broker: %w", err)
	}
	return nil
}

// openBroker declares the queue as kombu does and starts collecting
// replies.
func (e *Env) openBroker() error {
	conn, err := amqp091.DialConfig(e.AMQPURL, amqp091.Config{
		Heartbeat:  10 * time.Second,
		Properties: amqp091.Table{"connection_name": "replay-harness-" + e.Queue},
	})
	if err != nil {
		return fmt.Errorf("dial: %w", err)
	}
	e.pubMu.Lock()
	defer e.pubMu.Unlock()
	e.conn = conn
	if e.pub, err = conn.Channel(); err != nil {
		return fmt.Errorf("channel: %w", err)
	}
	if err := e.pub.Confirm(false); err != nil {
		return fmt.Errorf("confirm mode: %w", err)
	}
	ch := e.pub
	if err := ch.ExchangeDeclare(e.Queue, "direct", true, false, false, false, nil); err != nil {
		return fmt.Errorf("declare exchange: %w", err)
	}
	qargs := amqp091.Table{}
	if e.cfg.Quorum {
		qargs["x-queue-type"] = "quorum"
	}
	for k, v := range e.cfg.QueueArgs {
		qargs[k] = v
	}
	if _, err := ch.QueueDeclare(e.Queue, true, false, false, false, qargs); err != nil {
		return fmt.Errorf("declare queue: %w", err)
	}
	if err := ch.QueueBind(e.Queue, e.Queue, e.Queue, false, nil); err != nil {
		return fmt.Errorf("bind queue: %w", err)
	}
	if e.inspect, err = conn.Channel(); err != nil {
		return fmt.Errorf("channel: %w", err)
	}
	// The reply queue as a Celery client declares it (x-expires one day),
	// but not auto-delete, so that it outlives a broken connection; the
	// test deletes it at the end.
	if e.replyCh, err = conn.Channel(); err != nil {
		return fmt.Errorf("channel: %w", err)
	}
	_, err = e.replyCh.QueueDeclare(e.ReplyTo, e.cfg.DurableReplies, false, false, false,
		amqp091.Table{"x-expires": int32(86400000)})
	if err != nil {
		return fmt.Errorf("declare reply queue: %w", err)
	}
	// Replies are acknowledged once recorded: with automatic
	// acknowledgement, replies already sent to this connection when it
	// breaks would be gone, and a caller would wait for one the worker did
	// publish. A reply delivered again after a reconnect is recorded twice.
	msgs, err := e.replyCh.Consume(e.ReplyTo, "", false, false, false, false, nil)
	if err != nil {
		return fmt.Errorf("consume replies: %w", err)
	}
	e.wg.Add(1)
	go e.collect(msgs)
	return nil
}

func (e *Env) collect(msgs <-chan amqp091.Delivery) {
	defer e.wg.Done()
	for m := range msgs {
		var body struct {
			TaskID string          `json:"task_id"`
			Status string          `json:"status"`
			Result json.RawMessage `json:"result"`
		}
		r := Reply{TaskID: m.CorrelationId}
		if err := json.Unmarshal(m.Body, &body); err == nil {
			r.Status, r.Result = body.Status, body.Result
			if body.TaskID != m.CorrelationId {
				r.Status = "MISMATCHED_ID"
			}
			var exc struct {
				Type string `json:"exc_type"`
			}
			if r.Status != "SUCCESS" && json.Unmarshal(body.Result, &exc) == nil {
				r.ExcType = exc.Type
			}
		} else {
			r.Status = "UNDECODABLE"
		}
		e.mu.Lock()
		e.replies[r.TaskID] = append(e.replies[r.TaskID], r)
		e.mu.Unlock()
		_ = m.Ack(false) // a failed ack: the reply comes again on the next connection
	}
}

func (e *Env) close() {
	e.mu.Lock()
	ws := append([]*Worker(nil), e.workers...)
	e.mu.Unlock()
	for _, w := range ws {
		w.Kill()
	}
	e.pubMu.Lock()
	conn := e.conn
	e.pubMu.Unlock()
	if conn == nil {
		return
	}
	if ch, err := conn.Channel(); err == nil {
		_, _ = ch.QueueDelete(e.Queue, false, false, false)
		_, _ = ch.QueueDelete(e.Quarantine, false, false, false)
		_, _ = ch.QueueDelete(e.ReplyTo, false, false, false)
		_ = ch.ExchangeDelete(e.Queue, false, false)
	}
	_ = conn.Close()
	e.wg.Wait()
}

// Message builds the Celery protocol 2 message a Python producer sends for
// apply_async(args, kwargs, task_id=id) with the rpc result backend: the
// reply queue in reply_to, the id as correlation id and root id.
func (e *Env) Message(task, id string, args []any, kwargs map[string]any) *celeryproto.Message {
	return &celeryproto.Message{
		Protocol: 2, Task: task, ID: id, Args: args, Kwargs: kwargs,
		RootID: id, ReplyTo: e.ReplyTo, CorrelationID: id,
		Origin:   fmt.Sprintf("gen%d@replay", os.Getpid()),
		ArgsRepr: celeryproto.ArgsRepr(args), KwargsRepr: celeryproto.Repr(kwargs),
	}
}

// Send publishes a task with a new id and returns the id.
func (e *Env) Send(task string, args []any, kwargs map[string]any) string {
	e.t.Helper()
	id := testkit.NewID()
	e.Publish(e.Message(task, id, args, kwargs))
	return id
}

// Publish sends m to the queue as kombu does (default exchange, routing key
// the queue name, persistent) and waits for the broker's confirm.
func (e *Env) Publish(m *celeryproto.Message) {
	e.t.Helper()
	if err := e.TryPublish(context.Background(), m); err != nil {
		e.t.Fatalf("publish %s[%s]: %v", m.Task, m.ID, err)
	}
}

// TryPublish is Publish returning the error.
func (e *Env) TryPublish(ctx context.Context, m *celeryproto.Message) error {
	p, err := celeryproto.EncodeTask(m, celeryproto.EncodeOptions{Protocol: 2})
	if err != nil {
		return fmt.Errorf("encode: %w", err)
	}
	e.pubMu.Lock()
	defer e.pubMu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	conf, err := e.pub.PublishWithDeferredConfirmWithContext(ctx, "", e.Queue, false, false, amqp091.Publishing{
		ContentType: p.ContentType, ContentEncoding: p.ContentEncoding, Headers: amqp091.Table(p.Headers),
		Body: p.Body, CorrelationId: p.CorrelationID, ReplyTo: p.ReplyTo, DeliveryMode: amqp091.Persistent,
		Priority: p.Priority, Expiration: p.Expiration,
	})
	if err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	ok, err := conf.WaitContext(ctx)
	if err != nil {
		return fmt.Errorf("confirm: %w", err)
	}
	if !ok {
		return errors.New("broker nacked the message")
	}
	return nil
}

// PublishRaw sends an encoded message to an exchange with a routing key,
// persistent, and waits for the broker's confirm (e.g. a held message
// replayed by "onceler resolve --retry").
func (e *Env) PublishRaw(ctx context.Context, exchange, routingKey string, p *celeryproto.Publishing) error {
	e.pubMu.Lock()
	defer e.pubMu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	conf, err := e.pub.PublishWithDeferredConfirmWithContext(ctx, exchange, routingKey, false, false, amqp091.Publishing{
		ContentType: p.ContentType, ContentEncoding: p.ContentEncoding, Headers: amqp091.Table(p.Headers),
		Body: p.Body, CorrelationId: p.CorrelationID, ReplyTo: p.ReplyTo, DeliveryMode: amqp091.Persistent,
		Priority: p.Priority, Expiration: p.Expiration,
	})
	if err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	if ok, err := conf.WaitContext(ctx); err != nil || !ok {
		return fmt.Errorf("confirm: ok %v: %w", ok, err)
	}
	return nil
}

// Replies returns the results received so far for a task id; with a
// Redis result backend, the one stored result.
func (e *Env) Replies(id string) []Reply {
	if e.cfg.ResultBackend != "" {
		return e.storedReplies(id)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]Reply(nil), e.replies[id]...)
}

// ReplyCount returns how many task ids have at least one reply.
func (e *Env) ReplyCount() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.replies)
}

// WaitReplies waits until each id has at least n replies, and reports
// whether they all did within timeout.
func (e *Env) WaitReplies(ids []string, n int, timeout time.Duration) bool {
	if e.cfg.ResultBackend != "" {
		return e.waitStored(ids, timeout)
	}
	return testkit.Eventually(timeout, func() bool {
		e.mu.Lock()
		defer e.mu.Unlock()
		for _, id := range ids {
			if len(e.replies[id]) < n {
				return false
			}
		}
		return true
	})
}

// databaseURL adds application_name to the database URL, so that a test can
// find (and terminate) exactly this worker's connections.
func databaseURL(raw, app string) string {
	if u, err := url.Parse(raw); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		q := u.Query()
		q.Set("application_name", app)
		u.RawQuery = q.Encode()
		return u.String()
	}
	return raw + " application_name=" + app
}

// String shows the reply for test messages.
func (r Reply) String() string {
	return r.Status + " " + string(r.Result)
}
