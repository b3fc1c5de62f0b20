package control

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	amqp091 "github.com/onceler/onceler/internal/amqp091"
	"go.uber.org/zap"

	"github.com/onceler/onceler/amqp"
)

// Exchanges and queue arguments of Celery's pidbox and events, declared with
// the same flags as kombu (a mismatch closes the channel with 406).
const (
	PidboxExchange      = "celery.pidbox"       // fanout, not durable
	ReplyExchange       = "reply.celery.pidbox" // direct, not durable
	EventExchange       = "celeryev"            // topic, durable
	pidboxQueueSuffix   = ".celery.pidbox"
	pidboxQueueExpires  = int32(10000)  // ms: control_queue_expires 10 s
	pidboxQueueTTL      = int32(300000) // ms: control_queue_ttl 300 s
	offlineTimeout      = 2 * time.Second
	maxEventsPerMessage = 128 // task events per task.multi message
)

// Controller sends a worker's events on celeryev and answers remote control
// on celery.pidbox. A tasks.Worker runs one of its own; one made with New
// goes to a worker without (tasks.Config.NoControl) as its Config.Observer:
// it implements tasks.Observer (and tasks.TaskEventObserver, which spares
// the worker a map per event).
type Controller struct {
	cfg     Config
	w       atomic.Pointer[workerBox]
	log     *zap.Logger
	revoked *Revoked
	started time.Time
	pid     int

	clock      atomic.Int64 // Lamport clock
	taskEvents atomic.Bool
	running    atomic.Bool

	// events: task events, published in batches; sys: worker events.
	events  chan queuedEvent
	sys     chan queuedEvent
	pending atomic.Int64 // events queued or being published
	// utcoffset is computed once, at New
	utcoffset int

	evCh      atomic.Pointer[amqp091.Channel] // current event channel
	sent      atomic.Int64
	dropped   atomic.Int64
	failed    atomic.Int64
	commands  atomic.Int64
	connected atomic.Bool
	// connectedTo is the URL (redacted) of the last connection opened.
	connectedTo atomic.Pointer[string]
	sessions    atomic.Int64 // connections established

	mem memSamples // memsample's samples, for memdump

	// urlAt is the index, in the failover list of Config.URL, of the URL
	// the next connection attempt goes to (Run's goroutine only).
	urlAt int

	mu       sync.Mutex
	declared map[string]bool // reply exchanges declared on the current session
}

// New returns a Controller for worker w. Run starts it. w may be nil when
// the worker is made after the controller (the controller is the worker's
// Observer): give it with SetWorker; until then inspect commands answer as
// for a worker with no tasks.
func New(w Worker, cfg Config) (*Controller, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	c := &Controller{
		cfg:     cfg,
		log:     cfg.Logger.With(zap.String("node", cfg.NodeName)),
		revoked: NewRevoked(cfg.RevokedMax, cfg.RevokedTTL),
		pid:     os.Getpid(),
		events:  make(chan queuedEvent, cfg.EventBuffer),
		sys:     make(chan queuedEvent, 16),
	}
	c.utcoffset = utcoffset()
	c.taskEvents.Store(cfg.TaskEvents)
	if w != nil {
		c.SetWorker(w)
	}
	return c, nil
}

type workerBox struct{ Worker }

// SetWorker sets the worker the controller reports on and revokes in.
func (c *Controller) SetWorker(w Worker) {
	if w == nil {
		w = noWorker{}
	}
	c.w.Store(&workerBox{w})
	if ids := c.revoked.IDs(); len(ids) > 0 {
		w.Revoke(ids, false)
	}
}

func (c *Controller) worker() Worker {
	if b := c.w.Load(); b != nil {
		return b.Worker
	}
	return noWorker{}
}

// noWorker stands in until SetWorker.
type noWorker struct{}

func (noWorker) Registered() []string  { return nil }
func (noWorker) Active() []TaskInfo    { return nil }
func (noWorker) Reserved() []TaskInfo  { return nil }
func (noWorker) Scheduled() []TaskInfo { return nil }
func (noWorker) Revoke([]string, bool) {}
func (noWorker) Stats() map[string]any { return nil }
func (noWorker) Queues() []amqp.QueueSpec {
	return nil
}

// NodeName returns the node name the controller answers to.
func (c *Controller) NodeName() string { return c.cfg.NodeName }

// TaskEvents reports whether task events are being sent.
func (c *Controller) TaskEvents() bool { return c.taskEvents.Load() }

// SetTaskEvents turns task events on or off, as the enable_events and
// disable_events commands do. It reports whether the setting changed.
func (c *Controller) SetTaskEvents(on bool) bool { return c.taskEvents.Swap(on) != on }

// Revoked returns the set of ids revoked through this controller.
func (c *Controller) Revoked() *Revoked { return c.revoked }

// Counters returns the event counters: published messages' events, events
// dropped because the buffer was full or the broker unreachable, and control
// commands handled.
func (c *Controller) Counters() (sent, dropped, commands int64) {
	return c.sent.Load(), c.dropped.Load() + c.failed.Load(), c.commands.Load()
}

// Run connects to the broker, sends worker-online, heartbeats and events,
// and answers control requests until ctx is done; then it sends
// worker-offline and returns nil. It reconnects with backoff when the
// connection is lost. Run may be called once.
func (c *Controller) Run(ctx context.Context) error {
	if !c.running.CompareAndSwap(false, true) {
		return errors.New("control: Run called twice")
	}
	c.started = time.Now()
	var wg sync.WaitGroup
	pubCtx, stopPub := context.WithCancel(context.WithoutCancel(ctx))
	wg.Add(1)
	go func() { defer wg.Done(); c.publishLoop(pubCtx) }()
	defer func() { stopPub(); wg.Wait() }()

	online := false
	backoff := c.cfg.MinBackoff
	for {
		conn, err := c.dial(ctx)
		if err == nil {
			backoff = c.cfg.MinBackoff
			err = c.session(ctx, conn, &online)
			_ = conn.Close()
		}
		c.connected.Store(false)
		if ctx.Err() != nil {
			return nil
		}
		c.urlAt++ // failover: the next attempt goes to the next URL of the list
		c.log.Warn("control connection lost; reconnecting", zap.Error(err), zap.Duration("backoff", backoff))
		t := time.NewTimer(backoff + rand.N(backoff/2+1))
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
		backoff = min(2*backoff, c.cfg.MaxBackoff)
	}
}

// listDialTimeout bounds each attempt to a URL of a failover list of
// several when DialTimeout was not given.
const listDialTimeout = 5 * time.Second

// dial opens the controller's connection, bounded by ctx and DialTimeout.
func (c *Controller) dial(ctx context.Context) (*amqp091.Connection, error) {
	props := amqp091.NewConnectionProperties()
	props.SetClientConnectionName(c.cfg.ConnectionName)
	urls, err := amqp.DialURLs(c.cfg.URL)
	if err != nil {
		return nil, fmt.Errorf("control: %w", err)
	}
	timeout := c.cfg.DialTimeout
	if len(urls) > 1 && c.cfg.dialTimeoutDefault {
		timeout = min(timeout, listDialTimeout)
	}
	dctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var (
		mu      sync.Mutex
		netConn net.Conn
	)
	stop := context.AfterFunc(dctx, func() {
		mu.Lock()
		defer mu.Unlock()
		if netConn != nil {
			_ = netConn.SetDeadline(time.Unix(1, 0)) // unblocks the handshake
		}
	})
	defer stop()
	url := urls[c.urlAt%len(urls)]
	shown := amqp.RedactURL(url)
	conn, err := amqp091.DialConfig(url, amqp091.Config{
		Properties: props,
		Heartbeat:  controlHeartbeat,
		// amqp091 sets ServerName in the config it is given: a clone per
		// connection, so that each URL of a list is verified as itself.
		TLSClientConfig: c.cfg.TLS.Clone(),
		Dial: func(network, addr string) (net.Conn, error) {
			var d net.Dialer
			nc, err := d.DialContext(dctx, network, addr)
			if err != nil {
				return nil, err
			}
			if dl, ok := dctx.Deadline(); ok {
				_ = nc.SetDeadline(dl) // amqp091 clears it once open
			}
			mu.Lock()
			netConn = nc
			mu.Unlock()
			return nc, nil
		},
	})
	if err != nil {
		return nil, fmt.Errorf("control: dial %s: %w", shown, err)
	}
	if !stop() {
		_ = conn.Close()
		return nil, fmt.Errorf("control: dial %s: %w", shown, dctx.Err())
	}
	c.connectedTo.Store(&shown)
	return conn, nil
}

// session runs one connection: the pidbox consumer, the event channel and
// the heartbeat, until ctx is done or the connection fails.
func (c *Controller) session(ctx context.Context, conn *amqp091.Connection, online *bool) error {
	closed := conn.NotifyClose(make(chan *amqp091.Error, 1))
	evCh, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("control: open event channel: %w", err)
	}
	evClosed := evCh.NotifyClose(make(chan *amqp091.Error, 1))
	if err := evCh.ExchangeDeclare(EventExchange, "topic", true, false, false, false, nil); err != nil {
		return fmt.Errorf("control: declare exchange %s: %w", EventExchange, err)
	}
	ctlCh, deliveries, err := c.listen(conn)
	if err != nil {
		return err
	}
	c.mu.Lock()
	c.declared = map[string]bool{ReplyExchange: true}
	c.mu.Unlock()
	c.evCh.Store(evCh)
	c.connected.Store(true)
	c.sessions.Add(1)
	defer c.evCh.Store(nil)
	c.log.Info("control connected", zap.String("broker", *c.connectedTo.Load()), zap.String("queue", c.queueName()))

	if !*online {
		c.sendWorkerEvent("worker-online")
		*online = true
	} else {
		c.sendWorkerEvent("worker-heartbeat")
	}
	// Commands are handled on a goroutine of their own, so that a long one
	// never delays a heartbeat nor the response to ctx.
	cmdCtx, stopCmds := context.WithCancel(ctx)
	cmdsDone := make(chan struct{})
	go func() { defer close(cmdsDone); c.serve(cmdCtx, ctlCh, deliveries) }()
	defer func() { stopCmds(); <-cmdsDone }()
	tick := time.NewTicker(c.cfg.Heartbeat)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			c.goOffline(conn)
			return nil
		case err := <-closed:
			if err == nil {
				return errors.New("control: connection closed")
			}
			return fmt.Errorf("control: connection closed: %w", err)
		case err := <-evClosed:
			return fmt.Errorf("control: event channel closed: %w", err)
		case <-tick.C:
			c.sendWorkerEvent("worker-heartbeat")
		case <-cmdsDone:
			if ctx.Err() != nil { // it stopped because ctx ended
				c.goOffline(conn)
				return nil
			}
			return errors.New("control: pidbox consumer cancelled")
		}
	}
}

// serve handles the pidbox requests one at a time until ctx is done or the
// consumer ends.
func (c *Controller) serve(ctx context.Context, ch *amqp091.Channel, deliveries <-chan amqp091.Delivery) {
	for {
		select {
		case <-ctx.Done():
			return
		case d, ok := <-deliveries:
			if !ok {
				return
			}
			c.handle(ctx, ch, &d)
		}
	}
}

func (c *Controller) queueName() string { return c.cfg.NodeName + pidboxQueueSuffix }

// listen declares the pidbox exchange and this node's queue as kombu does
// and consumes it without acknowledgements.
func (c *Controller) listen(conn *amqp091.Connection) (*amqp091.Channel, <-chan amqp091.Delivery, error) {
	ch, err := conn.Channel()
	if err != nil {
		return nil, nil, fmt.Errorf("control: open pidbox channel: %w", err)
	}
	if err := ch.ExchangeDeclare(PidboxExchange, "fanout", false, false, false, false, nil); err != nil {
		return nil, nil, fmt.Errorf("control: declare exchange %s: %w", PidboxExchange, err)
	}
	if err := ch.ExchangeDeclare(ReplyExchange, "direct", false, false, false, false, nil); err != nil {
		return nil, nil, fmt.Errorf("control: declare exchange %s: %w", ReplyExchange, err)
	}
	q := c.queueName()
	args := amqp091.Table{"x-expires": pidboxQueueExpires, "x-message-ttl": pidboxQueueTTL}
	decl, err := ch.QueueDeclare(q, false, true, false, false, args)
	if err != nil {
		return nil, nil, fmt.Errorf("control: declare queue %s: %w", q, err)
	}
	if decl.Consumers > 0 {
		// as kombu's W_PIDBOX_IN_USE: two workers with one name share a
		// mailbox and each answers only part of the requests
		c.log.Warn("another worker is using this node name's mailbox: give each worker its own name", zap.String("queue", q), zap.Int("consumers", decl.Consumers))
	}
	if err := ch.QueueBind(q, "", PidboxExchange, false, nil); err != nil {
		return nil, nil, fmt.Errorf("control: bind queue %s: %w", q, err)
	}
	deliveries, err := ch.Consume(q, "", true, false, false, false, nil)
	if err != nil {
		return nil, nil, fmt.Errorf("control: consume %s: %w", q, err)
	}
	return ch, deliveries, nil
}

// goOffline flushes the queued events and sends worker-offline, waiting a
// little for both, on a context that the caller's cancellation does not end.
func (c *Controller) goOffline(conn *amqp091.Connection) {
	deadline := time.Now().Add(offlineTimeout)
	for c.pending.Load() > 0 && time.Now().Before(deadline) && !conn.IsClosed() {
		time.Sleep(5 * time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Until(deadline)+offlineTimeout)
	defer cancel()
	before := c.sent.Load()
	c.publishBatch(ctx, nil, []queuedEvent{c.workerEvent("worker-offline")})
	if c.sent.Load() == before {
		c.log.Warn("worker-offline not sent")
	}
}
