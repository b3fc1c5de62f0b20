package amqp

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/onceler/onceler/celeryproto"
	amqp091 "github.com/onceler/onceler/internal/amqp091"
	"github.com/onceler/onceler/internal/pause"
)

// PublishOptions tune one Publish.
type PublishOptions struct {
	// Mandatory asks the broker to return the message when no queue is
	// bound for it; Publish then fails with a *ReturnedError (ErrReturned)
	// instead of the message silently vanishing.
	Mandatory bool
	// Timeout bounds the publish, from the call to the broker's confirm, as
	// a deadline on ctx would, except that only unblocked time counts: the
	// time the broker blocks the publisher's connection (a memory or disk
	// alarm: the broker stops reading from connections that publish) does
	// not, so the publish waits out the alarm, sent or not, and then has
	// the unblocked time it had left, instead of failing with
	// ErrUnconfirmed and being sent again as a second copy. When it
	// runs out, the error wraps context.DeadlineExceeded. 0: ctx alone
	// bounds the publish.
	Timeout time.Duration
}

// Publisher publishes with publisher confirms over a connection of its own,
// separate from consuming so that a memory or disk alarm, which blocks
// publishing connections, never stops acknowledgements. It connects on first
// use and reconnects after any loss. It is safe for concurrent use: callers
// share one confirm-mode channel, each waiting only for its own confirm.
type Publisher struct {
	cfg Config
	log *zap.Logger
	ep  *failover

	// connecting is a context-aware lock held while dialing.
	connecting chan struct{}
	// isolated is a context-aware lock held by the one isolated publish
	// (publishIsolated) in progress; iso is its session, under mu.
	isolated  chan struct{}
	iso       *pubSession
	mu        sync.Mutex
	cur       *pubSession
	closed    bool
	connected bool // a connection opened once: refusals after that are retried
	backoff   backoff
	wg        sync.WaitGroup
	gen       atomic.Uint64
}

// NewPublisher returns a Publisher; it connects on first use.
func NewPublisher(cfg Config) *Publisher {
	cfg = cfg.withDefaults()
	log := cfg.Logger.Named("amqp.publisher")
	return &Publisher{
		cfg:        cfg,
		log:        log,
		ep:         newFailover(cfg, log),
		connecting: make(chan struct{}, 1),
		isolated:   make(chan struct{}, 1),
		backoff:    backoff{min: cfg.MinBackoff, max: cfg.MaxBackoff},
	}
}

// Publish sends msg to exchange ("" or DefaultExchange is the broker's
// default exchange, which routes by queue name) with routingKey
// and waits for the broker's confirm. The errors to act on: ErrNacked (not
// stored), ErrReturned (mandatory and unroutable), ErrUnconfirmed (outcome
// unknown: the channel died or ctx ended after the message was sent),
// ErrClosed, and a *RefusedError (IsPermanent) for a publish that can never
// succeed: no such exchange (ErrNotFound), a name or property over 255
// bytes (ErrTooLong), properties larger than a frame (ErrFrameTooLarge), a
// direct reply-to address the broker cannot read. A publish that could not
// be sent because the connection was down is retried on a new connection
// until ctx ends.
//
// Publishes to a direct reply-to address (routing key
// "amq.rabbitmq.reply-to.*") go one at a time over a connection of their
// own: RabbitMQ closes the connection (541 INTERNAL_ERROR) on an address it
// cannot decode, which must cost neither the other publishes nor the
// shared channel, and is then known to be this publish's refusal.
func (p *Publisher) Publish(ctx context.Context, exchange, routingKey string, msg *celeryproto.Publishing, o PublishOptions) (err error) {
	if msg == nil {
		return fmt.Errorf("publish to %q/%q: nil message", exchange, routingKey)
	}
	if exchange == DefaultExchange {
		exchange = ""
	}
	headers, err := toTable(msg.Headers)
	if err != nil {
		return fmt.Errorf("publish to %q/%q: %w", exchange, routingKey, err)
	}
	pub := amqp091.Publishing{
		ContentType:     msg.ContentType,
		ContentEncoding: msg.ContentEncoding,
		Headers:         headers,
		Body:            msg.Body,
		CorrelationId:   msg.CorrelationID,
		ReplyTo:         msg.ReplyTo,
		DeliveryMode:    msg.DeliveryMode,
		Priority:        msg.Priority,
		Expiration:      msg.Expiration,
	}
	if err := checkNames(exchange, routingKey, &pub); err != nil {
		return err
	}
	if o.Timeout > 0 {
		tctx, stop := p.withTimeout(ctx, o.Timeout)
		defer stop()
		defer func(parent context.Context) {
			if err != nil && parent.Err() == nil && errors.Is(context.Cause(tctx), errPublishTimeout) {
				err = fmt.Errorf("%w (%w)", err, errPublishTimeout)
			}
		}(ctx)
		ctx = tctx
	}
	if exchange == "" && strings.HasPrefix(routingKey, directReplyPrefix) {
		return p.publishIsolated(ctx, routingKey, pub, o)
	}
	for {
		s, err := p.session(ctx)
		if err != nil {
			return fmt.Errorf("publish to %q/%q: %w", exchange, routingKey, err)
		}
		if err := checkFrame(exchange, routingKey, &pub, s.conn.Config.FrameSize); err != nil {
			return err
		}
		err = s.publish(ctx, exchange, routingKey, pub, o)
		if errors.Is(err, errNotSent) {
			// The frame never left: safe to send again on a new connection.
			p.drop(s)
			continue
		}
		if err != nil {
			return fmt.Errorf("publish to %q/%q: %w", exchange, routingKey, err)
		}
		return nil
	}
}

// errPublishTimeout is the cause of a publish's end at its
// PublishOptions.Timeout.
var errPublishTimeout = fmt.Errorf("amqp: no confirm within the publish timeout: %w", context.DeadlineExceeded)

// withTimeout returns ctx, ended once d of unblocked time has passed: time
// during which the broker blocks a connection of the publisher does not
// count. A publish waiting on a blocked connection is not given up, nor one
// whose block ended with time left; one whose confirm the broker owes on a
// connection it reads for d in all is. The block is sampled every
// d/40 (at most every 250 ms). stop releases the timer.
func (p *Publisher) withTimeout(ctx context.Context, d time.Duration) (context.Context, func()) {
	ctx, cancel := context.WithCancelCause(ctx)
	done := make(chan struct{})
	step := min(max(d/40, time.Millisecond), 250*time.Millisecond)
	go func() {
		t := time.NewTicker(step)
		defer t.Stop()
		var used time.Duration
		last := time.Now()
		for {
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case now := <-t.C:
				if !p.blocked() {
					used += now.Sub(last)
				}
				last = now
				if used >= d {
					cancel(errPublishTimeout)
					return
				}
			}
		}
	}()
	return ctx, func() {
		close(done)
		cancel(nil)
	}
}

// blocked reports whether the broker blocks a connection of the publisher
// (a resource alarm).
func (p *Publisher) blocked() bool {
	p.mu.Lock()
	s, iso := p.cur, p.iso
	p.mu.Unlock()
	return (s != nil && s.isBlocked()) || (iso != nil && iso.isBlocked())
}

// session returns the live session, connecting when there is none.
func (p *Publisher) session(ctx context.Context) (*pubSession, error) {
	for {
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			return nil, ErrClosed
		}
		s := p.cur
		p.mu.Unlock()
		if s != nil && !s.isDead() {
			return s, nil
		}
		select {
		case p.connecting <- struct{}{}:
		case <-ctx.Done():
			return nil, fmt.Errorf("connect: %w", ctx.Err())
		}
		s, err := p.connect(ctx)
		<-p.connecting
		if s != nil || err != nil {
			return s, err
		}
	}
}

// connect dials until it succeeds or ctx ends; the caller holds connecting.
// It returns (nil, nil) when another caller connected meanwhile.
func (p *Publisher) connect(ctx context.Context) (*pubSession, error) {
	var lastErr error
	for {
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			return nil, ErrClosed
		}
		if p.cur != nil && !p.cur.isDead() {
			p.mu.Unlock()
			return nil, nil
		}
		if p.cur != nil {
			// Lost: the next connection goes to the next URL (once: the
			// dead session is forgotten, as by drop).
			p.ep.failed(p.cur.ep)
			p.cur = nil
		}
		p.mu.Unlock()
		s, err := p.open(ctx)
		if err == nil {
			p.mu.Lock()
			if p.closed {
				p.mu.Unlock()
				_ = s.conn.Close()
				return nil, ErrClosed
			}
			p.cur = s
			p.connected = true
			p.backoff.reset()
			p.mu.Unlock()
			return s, nil
		}
		if errors.Is(err, ErrConfig) {
			return nil, err
		}
		if p.refusedFirst(err) {
			// Wrong credentials or vhost: said at once, not after retrying
			// until the caller's deadline hides why.
			return nil, fmt.Errorf("%w: %w", ErrAccessRefused, err)
		}
		if ctx.Err() != nil {
			if lastErr != nil {
				return nil, fmt.Errorf("%w (previous attempt: %w)", err, lastErr)
			}
			return nil, err
		}
		lastErr = err
		wait := p.backoff.next()
		p.log.Warn("publisher connect failed; retrying", zap.Error(err), zap.Duration("backoff", wait))
		if !pause.For(ctx, wait) {
			return nil, fmt.Errorf("connect: %w (last error: %w)", ctx.Err(), err)
		}
	}
}

// refusedFirst reports whether err is the broker refusing the credentials
// (403) or the vhost (530) before this publisher ever connected. Once it has
// connected, a refusal is retried like any loss: it may be a node that is
// still starting.
func (p *Publisher) refusedFirst(err error) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	ae := brokerError(err)
	return !p.connected && ae != nil && (ae.Code == amqp091.AccessRefused || ae.Code == amqp091.NotAllowed)
}

// open dials one connection and starts its watcher.
func (p *Publisher) open(ctx context.Context) (*pubSession, error) {
	conn, ep, err := p.ep.dial(ctx, "publish")
	if err != nil {
		return nil, err
	}
	ch, err := conn.Channel()
	if err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("open channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("enable confirms: %w", err)
	}
	s := &pubSession{
		conn:  conn,
		ch:    ch,
		gen:   p.gen.Add(1),
		ep:    ep,
		dead:  make(chan struct{}),
		byID:  make(map[string]*mandatoryWait),
		byTag: make(map[uint64]*mandatoryWait),
	}
	w := watchers{
		connClosed: conn.NotifyClose(make(chan *amqp091.Error, 1)),
		blocked:    conn.NotifyBlocked(make(chan amqp091.Blocking, 4)),
		chClosed:   ch.NotifyClose(make(chan *amqp091.Error, 1)),
		returns:    ch.NotifyReturn(make(chan amqp091.Return, 256)),
		confirms:   ch.NotifyPublish(make(chan amqp091.Confirmation, 4096)),
	}
	// Adding to wg under mu with closed unset orders it before Close's Wait.
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		_ = conn.Close()
		drainWatchers(w)
		return nil, ErrClosed
	}
	p.wg.Add(1)
	p.mu.Unlock()
	go func() {
		defer p.wg.Done()
		s.watch(w, p.log)
	}()
	p.log.Info("publisher connected", zap.String("broker", p.ep.shown(ep)), zap.Uint64("generation", s.gen))
	return s, nil
}

// drop forgets s if it is still current, so the next call reconnects.
func (p *Publisher) drop(s *pubSession) {
	_ = s.conn.Close()
	p.mu.Lock()
	if p.cur == s {
		p.cur = nil
		p.ep.failed(s.ep)
	}
	p.mu.Unlock()
}

// Declare is DeclareQueue without the queue as found.
func (p *Publisher) Declare(ctx context.Context, q QueueSpec) error {
	_, err := p.DeclareQueue(ctx, q)
	return err
}

// DeclareQueue makes sure q exists as the consumer does (see "Queues" in
// the package documentation): an existing queue is left with its flags and
// arguments, a missing one is declared with q's, and it is bound as Celery
// binds it. A passive q is only checked. It works on short-lived channels
// of the publisher's connection, so a refused declare never closes the
// publishing channel. It returns the queue as found: for a queue that
// existed, its flags and arguments as the broker holds them (see
// Consumer.Queues). A declare the broker refuses for what it asks (406 for
// arguments it does not accept, 403 reserved name, 404 for a passive
// declare) or a name over 255 bytes is a *RefusedError (IsPermanent); a
// 406 is also a *PreconditionError.
func (p *Publisher) DeclareQueue(ctx context.Context, q QueueSpec) (QueueSpec, error) {
	if len(q.Name) > shortMax {
		return QueueSpec{}, refused("declare queue", "", q.Name, 0,
			fmt.Sprintf("queue name of %d bytes is longer than an AMQP short string (255 bytes)", len(q.Name)), ErrTooLong)
	}
	var st queueState
	err := p.withConn(ctx, func(conn *amqp091.Connection, ch *amqp091.Channel) error {
		sc := &scratch{conn: conn, ch: ch}
		defer sc.close()
		var err error
		st, err = ensure(sc, q, nil)
		if errors.Is(err, ErrPrecondition) || errors.Is(err, ErrAccessRefused) || (q.Passive && errors.Is(err, ErrNotFound)) {
			return refused("declare queue", "", q.Name, 0, err.Error(), err)
		}
		return err
	})
	if err != nil {
		return QueueSpec{}, err
	}
	return st.spec, nil
}

// DeleteQueue deletes a queue, returning how many messages it held.
func (p *Publisher) DeleteQueue(ctx context.Context, name string) (int, error) {
	var n int
	err := p.withChannel(ctx, func(ch *amqp091.Channel) error {
		var err error
		n, err = ch.QueueDelete(name, false, false, false)
		if err != nil {
			return fmt.Errorf("delete queue %q: %w", name, err)
		}
		return nil
	})
	return n, err
}

// withChannel runs fn on a fresh channel of the publisher's connection and
// closes it after. fn's RPCs are not context-aware; ctx bounds connecting.
func (p *Publisher) withChannel(ctx context.Context, fn func(*amqp091.Channel) error) error {
	return p.withConn(ctx, func(_ *amqp091.Connection, ch *amqp091.Channel) error {
		err := fn(ch)
		_ = ch.Close()
		return err
	})
}

// withConn runs fn with the publisher's connection and a fresh channel of
// it, which fn closes.
func (p *Publisher) withConn(ctx context.Context, fn func(*amqp091.Connection, *amqp091.Channel) error) error {
	for {
		s, err := p.session(ctx)
		if err != nil {
			return err
		}
		ch, err := s.conn.Channel()
		if err != nil {
			if s.isDead() || errors.Is(err, amqp091.ErrClosed) {
				p.drop(s)
				continue
			}
			return fmt.Errorf("open channel: %w", err)
		}
		return fn(s.conn, ch)
	}
}

// Close closes the connection and waits for the publisher's goroutines.
// Publishes still waiting for a confirm get ErrUnconfirmed.
func (p *Publisher) Close() error {
	p.mu.Lock()
	p.closed = true
	s := p.cur
	p.cur = nil
	if p.iso != nil {
		_ = p.iso.conn.Close()
	}
	p.mu.Unlock()
	var err error
	if s != nil {
		if cerr := s.conn.Close(); cerr != nil && !errors.Is(cerr, amqp091.ErrClosed) {
			err = fmt.Errorf("close publisher connection: %w", cerr)
		}
	}
	p.wg.Wait()
	return err
}
