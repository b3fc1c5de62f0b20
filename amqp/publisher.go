package amqp

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"go.uber.org/zap"

	"github.com/onceler/onceler/celeryproto"
)

// PublishOptions tune one Publish.
type PublishOptions struct {
	// Mandatory asks the broker to return the message when no queue is
	// bound for it; Publish then fails with a *ReturnedError (ErrReturned)
	// instead of the message silently vanishing.
	Mandatory bool
}

// Publisher publishes with publisher confirms over a connection of its own,
// separate from consuming so that a memory or disk alarm, which blocks
// publishing connections, never stops acknowledgements. It connects on first
// use and reconnects after any loss. It is safe for concurrent use: callers
// share one confirm-mode channel, each waiting only for its own confirm.
type Publisher struct {
	cfg Config
	log *zap.Logger

	// connecting is a context-aware lock held while dialing.
	connecting chan struct{}
	mu         sync.Mutex
	cur        *pubSession
	closed     bool
	backoff    backoff
	wg         sync.WaitGroup
	gen        atomic.Uint64
}

// NewPublisher returns a Publisher; it connects on first use.
func NewPublisher(cfg Config) *Publisher {
	cfg = cfg.withDefaults()
	return &Publisher{
		cfg:        cfg,
		log:        cfg.Logger.Named("amqp.publisher"),
		connecting: make(chan struct{}, 1),
		backoff:    backoff{min: cfg.MinBackoff, max: cfg.MaxBackoff},
	}
}

// pubSession is one connection with its confirm-mode channel.
type pubSession struct {
	conn *amqp091.Connection
	ch   *amqp091.Channel
	gen  uint64
	// dead is closed when the connection or channel is gone.
	dead    chan struct{}
	deadErr error // set before dead is closed
	// blocked is non-nil while the broker blocks publishing (alarm).
	blockMu sync.Mutex
	blocked chan struct{}

	// Mandatory publishes: the return for a message id, and the waiters by
	// delivery tag woken once the confirm for their tag was processed
	// (RabbitMQ sends basic.return before the basic.ack of that message).
	mu        sync.Mutex
	byID      map[string]*mandatoryWait
	byTag     map[uint64]*mandatoryWait
	confirmed uint64 // highest delivery tag processed by the watcher
	seq       atomic.Uint64

	exchanges sync.Map // exchange name -> struct{}: known to exist
}

type mandatoryWait struct {
	tag  uint64
	ret  *amqp091.Return
	done chan struct{}
}

// Publish sends p to exchange ("" is the default exchange) with routingKey
// and waits for the broker's confirm. The errors to act on: ErrNacked (not
// stored), ErrReturned (mandatory and unroutable), ErrUnconfirmed (outcome
// unknown: the channel died or ctx ended after the message was sent),
// ErrNotFound (no such exchange), ErrClosed. A publish that could not be
// sent because the connection was down is retried on a new connection until
// ctx ends.
func (p *Publisher) Publish(ctx context.Context, exchange, routingKey string, msg *celeryproto.Publishing, o PublishOptions) error {
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
	for {
		s, err := p.session(ctx)
		if err != nil {
			return fmt.Errorf("publish to %q/%q: %w", exchange, routingKey, err)
		}
		err = s.publish(ctx, p, exchange, routingKey, pub, o)
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

// errNotSent marks a publish that failed before its frame was written.
var errNotSent = errors.New("amqp: publish not sent")

func (s *pubSession) publish(ctx context.Context, p *Publisher, exchange, key string, pub amqp091.Publishing, o PublishOptions) error {
	if err := s.waitUnblocked(ctx); err != nil {
		return err
	}
	if exchange != "" {
		if err := s.checkExchange(exchange); err != nil {
			return err
		}
	}
	var w *mandatoryWait
	if o.Mandatory {
		// The message id ties a basic.return to this publish.
		pub.MessageId = "onceler-" + strconv.FormatUint(s.gen, 36) + "-" + strconv.FormatUint(s.seq.Add(1), 36)
		w = &mandatoryWait{done: make(chan struct{})}
		s.mu.Lock()
		s.byID[pub.MessageId] = w
		s.mu.Unlock()
		defer func() {
			s.mu.Lock()
			delete(s.byID, pub.MessageId)
			if w.tag != 0 && s.byTag[w.tag] == w {
				delete(s.byTag, w.tag)
			}
			s.mu.Unlock()
		}()
	}
	dc, err := s.ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, o.Mandatory, false, pub)
	if err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if errors.Is(err, amqp091.ErrClosed) || s.isDead() {
			return errNotSent
		}
		return err
	}
	if w != nil {
		s.mu.Lock()
		w.tag = dc.DeliveryTag
		if s.confirmed >= w.tag {
			close(w.done)
		} else {
			s.byTag[w.tag] = w
		}
		s.mu.Unlock()
	}
	select {
	case <-dc.Done():
	case <-ctx.Done():
		return fmt.Errorf("%w: %w", ErrUnconfirmed, ctx.Err())
	}
	if !dc.Acked() {
		if s.ch.IsClosed() {
			return fmt.Errorf("%w: %w", ErrUnconfirmed, s.reason())
		}
		return ErrNacked
	}
	if w == nil {
		return nil
	}
	select {
	case <-w.done:
	case <-s.dead:
		// The confirm came, so the return (sent before it) was queued; but
		// the watcher stopped before processing it: unknown.
		s.mu.Lock()
		ret := w.ret
		s.mu.Unlock()
		if ret == nil {
			return fmt.Errorf("%w: channel closed before the return check: %w", ErrUnconfirmed, s.reason())
		}
	case <-ctx.Done():
		return fmt.Errorf("%w: %w", ErrUnconfirmed, ctx.Err())
	}
	s.mu.Lock()
	ret := w.ret
	s.mu.Unlock()
	if ret != nil {
		return &ReturnedError{Exchange: ret.Exchange, RoutingKey: ret.RoutingKey, Code: int(ret.ReplyCode), Text: ret.ReplyText}
	}
	return nil
}

// checkExchange passively declares a named exchange once per connection, on
// a side channel: publishing to a missing exchange would close the shared
// channel and leave every concurrent publish unconfirmed.
func (s *pubSession) checkExchange(name string) error {
	if _, ok := s.exchanges.Load(name); ok {
		return nil
	}
	ch, err := s.conn.Channel()
	if err != nil {
		return errNotSent
	}
	defer func() { _ = ch.Close() }()
	if err := ch.ExchangeDeclarePassive(name, amqp091.ExchangeDirect, true, false, false, false, nil); err != nil {
		if ae := brokerError(err); ae != nil && ae.Code == amqp091.NotFound {
			return fmt.Errorf("exchange %q: %w: %s", name, ErrNotFound, ae.Reason)
		}
		if s.isDead() {
			return errNotSent
		}
		return fmt.Errorf("check exchange %q: %w", name, err)
	}
	s.exchanges.Store(name, struct{}{})
	return nil
}

func (s *pubSession) waitUnblocked(ctx context.Context) error {
	s.blockMu.Lock()
	b := s.blocked
	s.blockMu.Unlock()
	if b == nil {
		return nil
	}
	select {
	case <-b:
		return nil
	case <-s.dead:
		return errNotSent
	case <-ctx.Done():
		return fmt.Errorf("broker blocks publishing (resource alarm): %w", ctx.Err())
	}
}

func (s *pubSession) isDead() bool {
	select {
	case <-s.dead:
		return true
	default:
		return false
	}
}

func (s *pubSession) reason() error {
	select {
	case <-s.dead:
		if s.deadErr != nil {
			return s.deadErr
		}
	default:
	}
	return amqp091.ErrClosed
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
			p.backoff.reset()
			p.mu.Unlock()
			return s, nil
		}
		if errors.Is(err, ErrConfig) {
			return nil, err
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
		if !sleep(ctx, wait) {
			return nil, fmt.Errorf("connect: %w (last error: %w)", ctx.Err(), err)
		}
	}
}

// open dials one connection and starts its watcher.
func (p *Publisher) open(ctx context.Context) (*pubSession, error) {
	conn, err := p.cfg.dial(ctx, "publish")
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
	p.log.Info("publisher connected", zap.Uint64("generation", s.gen))
	return s, nil
}

// drainWatchers empties notification channels nobody else reads, until
// amqp091 closes them.
func drainWatchers(w watchers) {
	for range w.connClosed {
	}
	for range w.chClosed {
	}
	for range w.blocked {
	}
	for range w.returns {
	}
	for range w.confirms {
	}
}

type watchers struct {
	connClosed, chClosed <-chan *amqp091.Error
	blocked              <-chan amqp091.Blocking
	returns              <-chan amqp091.Return
	confirms             <-chan amqp091.Confirmation
}

// watch drains every notification channel of the session until amqp091
// closes them all, and wakes mandatory publishers.
func (s *pubSession) watch(w watchers, log *zap.Logger) {
	died := false
	closeDone := make(chan struct{})
	die := func(e *amqp091.Error, what string) {
		if died {
			return
		}
		err := fmt.Errorf("%s closed: %w", what, errOrClosed(e))
		died = true
		s.deadErr = err
		close(s.dead)
		// Closing from another goroutine: amqp091's reader may be waiting
		// for this loop to take a notification.
		go func() {
			defer close(closeDone)
			_ = s.conn.Close()
		}()
		s.setBlocked(false)
		if e != nil { // nil: closed by us
			log.Warn("publisher connection lost", zap.Error(err), zap.Uint64("generation", s.gen))
		}
	}
	defer func() { <-closeDone }()
	for w.connClosed != nil || w.chClosed != nil || w.blocked != nil || w.returns != nil || w.confirms != nil {
		select {
		case e, ok := <-w.connClosed:
			if !ok {
				w.connClosed = nil
			}
			die(e, "connection")
		case e, ok := <-w.chClosed:
			if !ok {
				w.chClosed = nil
			}
			die(e, "channel")
		case b, ok := <-w.blocked:
			if !ok {
				w.blocked = nil
				continue
			}
			if b.Active {
				log.Warn("broker blocks publishing", zap.String("reason", b.Reason))
			} else {
				log.Info("broker unblocked publishing")
			}
			s.setBlocked(b.Active)
		case r, ok := <-w.returns:
			if !ok {
				w.returns = nil
				continue
			}
			s.recordReturn(r)
		case c, ok := <-w.confirms:
			if !ok {
				w.confirms = nil
				continue
			}
			// Returns precede their confirm: take those already queued.
			for drained := false; !drained && w.returns != nil; {
				select {
				case r, ok := <-w.returns:
					if !ok {
						w.returns = nil
						break
					}
					s.recordReturn(r)
				default:
					drained = true
				}
			}
			s.confirm(c.DeliveryTag)
		}
	}
	die(nil, "connection")
	s.mu.Lock()
	for tag, mw := range s.byTag {
		delete(s.byTag, tag)
		close(mw.done)
	}
	s.mu.Unlock()
}

func (s *pubSession) recordReturn(r amqp091.Return) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if w := s.byID[r.MessageId]; w != nil {
		w.ret = &r
	}
}

func (s *pubSession) confirm(tag uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	prev := s.confirmed
	s.confirmed = tag
	if len(s.byTag) == 0 {
		return
	}
	if tag == prev+1 {
		if w := s.byTag[tag]; w != nil {
			delete(s.byTag, tag)
			close(w.done)
		}
		return
	}
	for t, w := range s.byTag { // a gap: a notification was lost
		if t <= tag {
			delete(s.byTag, t)
			close(w.done)
		}
	}
}

func (s *pubSession) setBlocked(active bool) {
	s.blockMu.Lock()
	defer s.blockMu.Unlock()
	switch {
	case active && s.blocked == nil:
		s.blocked = make(chan struct{})
	case !active && s.blocked != nil:
		close(s.blocked)
		s.blocked = nil
	}
}

// drop forgets s if it is still current, so the next call reconnects.
func (p *Publisher) drop(s *pubSession) {
	_ = s.conn.Close()
	p.mu.Lock()
	if p.cur == s {
		p.cur = nil
	}
	p.mu.Unlock()
}

// Declare declares q (or checks it, when passive) on a short-lived channel
// of the publisher's connection, so a refused declare never closes the
// publishing channel. A conflict is a *PreconditionError.
func (p *Publisher) Declare(ctx context.Context, q QueueSpec) error {
	return p.withChannel(ctx, func(ch *amqp091.Channel) error { return declare(ch, q) })
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
		err = fn(ch)
		_ = ch.Close()
		return err
	}
}

// Close closes the connection and waits for the publisher's goroutines.
// Publishes still waiting for a confirm get ErrUnconfirmed.
func (p *Publisher) Close() error {
	p.mu.Lock()
	p.closed = true
	s := p.cur
	p.cur = nil
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
