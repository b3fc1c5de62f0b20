package amqp

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	amqp091 "github.com/onceler/onceler/internal/amqp091"

	"github.com/onceler/onceler/internal/pause"
)

// pubSession is one connection with its confirm-mode channel.
type pubSession struct {
	conn *amqp091.Connection
	ch   *amqp091.Channel
	gen  uint64
	ep   int // the index of its URL in the failover list
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
	watchDone bool   // the watcher ended: no more confirms or returns
	seq       atomic.Uint64

	exchanges sync.Map // exchange name -> struct{}: known to exist
}

type mandatoryWait struct {
	tag  uint64
	ret  *amqp091.Return
	done chan struct{}
}

// errNotSent marks a publish that failed before its frame was written.
var errNotSent = errors.New("amqp: publish not sent")

func (s *pubSession) publish(ctx context.Context, exchange, key string, pub amqp091.Publishing, o PublishOptions) error {
	if err := s.waitUnblocked(ctx); err != nil {
		return err
	}
	if exchange != "" {
		if _, ok := s.exchanges.Load(exchange); !ok {
			return s.publishFirst(ctx, exchange, key, pub, o)
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
		return s.publishErr(ctx, err)
	}
	if w != nil {
		s.mu.Lock()
		w.tag = dc.DeliveryTag
		if s.confirmed >= w.tag || s.watchDone {
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
	// The watcher closes done once it processed this tag's confirm, or when
	// it ends; either way every return amqp091 passed on is recorded, since
	// RabbitMQ sends basic.return before the basic.ack of that message.
	select {
	case <-w.done:
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

// publishFirst publishes the first message of the session to a named
// exchange on a side channel of its own, after a passive declare: a
// missing exchange (404), or one the user may not publish to (an internal
// exchange, 403), would close the shared channel and leave every
// concurrent publish unconfirmed. On the side channel the refusal is this
// publish's alone, and a *RefusedError. Once a publish to the exchange is
// confirmed, the next ones go on the shared channel.
// publishErr is what the caller acts on when a publish call failed: the
// caller's context ended, errNotSent (the connection is gone: nothing was
// written), or err.
func (s *pubSession) publishErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if errors.Is(err, amqp091.ErrClosed) || s.isDead() {
		return errNotSent
	}
	return err
}

// missingExchangeLooks and missingExchangeGrace: a missing exchange is
// looked at this often, this far apart, before it is a refusal: an
// application may declare it a moment later, or declare it again after a
// broker restart took it (not durable).
const (
	missingExchangeLooks = 4
	missingExchangeGrace = 500 * time.Millisecond
)

// publishFirst is the first publish to exchange name on this connection
// (publishFirstOnce), with a missing exchange looked at again a few times
// before it counts as refused.
func (s *pubSession) publishFirst(ctx context.Context, name, key string, pub amqp091.Publishing, o PublishOptions) error {
	for look := 1; ; look++ {
		err := s.publishFirstOnce(ctx, name, key, pub, o)
		if look >= missingExchangeLooks || !errors.Is(err, ErrNotFound) {
			return err
		}
		t := time.NewTimer(missingExchangeGrace)
		select {
		case <-ctx.Done():
			t.Stop()
			return err
		case <-t.C:
		}
	}
}

func (s *pubSession) publishFirstOnce(ctx context.Context, name, key string, pub amqp091.Publishing, o PublishOptions) error {
	ch, err := s.conn.Channel()
	if err != nil {
		if errors.Is(err, amqp091.ErrClosed) || s.isDead() {
			return errNotSent
		}
		return fmt.Errorf("publish to exchange %s: open channel: %w", shown(name), err)
	}
	defer func() { _ = ch.Close() }()
	closed := ch.NotifyClose(make(chan *amqp091.Error, 1))
	returns := ch.NotifyReturn(make(chan amqp091.Return, 1))
	if err := ch.ExchangeDeclarePassive(name, amqp091.ExchangeDirect, true, false, false, false, nil); err != nil {
		if ae := brokerError(err); ae != nil && ae.Code == amqp091.NotFound {
			return refused("publish", name, key, ae.Code, ae.Reason, fmt.Errorf("exchange %s: %w", shown(name), ErrNotFound))
		}
		if s.isDead() {
			return errNotSent
		}
		return fmt.Errorf("check exchange %s: %w", shown(name), err)
	}
	if err := ch.Confirm(false); err != nil {
		if s.isDead() {
			return errNotSent
		}
		return fmt.Errorf("publish to exchange %s: enable confirms: %w", shown(name), err)
	}
	dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, name, key, o.Mandatory, false, pub)
	if err != nil {
		return s.publishErr(ctx, err)
	}
	select {
	case <-dc.Done():
	case <-ctx.Done():
		return fmt.Errorf("%w: %w", ErrUnconfirmed, ctx.Err())
	}
	if dc.Acked() {
		// RabbitMQ sends basic.return before the ack; amqp091 passed it on
		// before it took the ack.
		s.exchanges.Store(name, struct{}{})
		select {
		case r, ok := <-returns:
			if ok {
				return &ReturnedError{Exchange: r.Exchange, RoutingKey: r.RoutingKey, Code: int(r.ReplyCode), Text: r.ReplyText}
			}
		default:
		}
		return nil
	}
	// amqp091 tells the channel's close before it ends the confirms.
	select {
	case e := <-closed:
		if e != nil && e.Server && (e.Code == amqp091.AccessRefused || e.Code == amqp091.NotFound) {
			return refused("publish", name, key, e.Code, e.Reason, e)
		}
	default:
	}
	if ch.IsClosed() || s.isDead() {
		return fmt.Errorf("%w: %w", ErrUnconfirmed, s.reason())
	}
	return ErrNacked
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

// isBlocked reports whether the broker blocks the connection now.
func (s *pubSession) isBlocked() bool {
	s.blockMu.Lock()
	defer s.blockMu.Unlock()
	return s.blocked != nil
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
	s.watchDone = true
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

// directReplyPrefix starts the routing keys of RabbitMQ's direct reply-to
// addresses.
const directReplyPrefix = "amq.rabbitmq.reply-to."

// publishIsolated publishes to a direct reply-to address over a connection
// of its own, one publish at a time, closed after. RabbitMQ closes the
// connection when it cannot decode the address (541 INTERNAL_ERROR, or
// another channel or connection error it raises): on this connection that
// answer can only be this publish's, and is a *RefusedError. A connection
// lost for another reason (a forced close, the network) is retried as in
// Publish.
func (p *Publisher) publishIsolated(ctx context.Context, key string, pub amqp091.Publishing, o PublishOptions) error {
	select {
	case p.isolated <- struct{}{}:
	case <-ctx.Done():
		return fmt.Errorf("publish to %q: %w", shown(key), ctx.Err())
	}
	defer func() { <-p.isolated }()
	bo := backoff{min: p.cfg.MinBackoff, max: p.cfg.MaxBackoff}
	for {
		s, err := p.open(ctx)
		if err != nil {
			if errors.Is(err, ErrClosed) || errors.Is(err, ErrConfig) || ctx.Err() != nil || p.refusedFirst(err) {
				return fmt.Errorf("publish to %q: %w", shown(key), err)
			}
			if !pause.For(ctx, bo.next()) {
				return fmt.Errorf("publish to %q: connect: %w (last error: %w)", shown(key), ctx.Err(), err)
			}
			continue
		}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			_ = s.conn.Close()
			return ErrClosed
		}
		p.iso = s
		p.mu.Unlock()
		if err = checkFrame("", key, &pub, s.conn.Config.FrameSize); err == nil {
			err = s.publish(ctx, "", key, pub, o)
		}
		if err != nil && !IsPermanent(err) && ctx.Err() == nil {
			// Give the connection's close a moment to arrive with its reason.
			t := time.NewTimer(2 * time.Second)
			select {
			case <-s.dead:
			case <-t.C:
			}
			t.Stop()
			if ae := brokerError(s.reason()); ae != nil && ae.Server && refusalCode(ae.Code) {
				err = refused("publish", "", key, ae.Code, ae.Reason, ae)
			}
		}
		_ = s.conn.Close()
		p.mu.Lock()
		p.iso = nil
		p.mu.Unlock()
		if errors.Is(err, errNotSent) {
			continue
		}
		if err != nil && !IsPermanent(err) {
			return fmt.Errorf("publish to %q: %w", shown(key), err)
		}
		return err
	}
}

// refusalCode reports whether a broker's close code answers what was sent
// rather than the state of the broker or the network.
func refusalCode(code int) bool {
	switch code {
	case amqp091.NotFound, amqp091.AccessRefused, amqp091.PreconditionFailed, amqp091.InternalError,
		amqp091.SyntaxError, amqp091.CommandInvalid, amqp091.FrameError, amqp091.NotAllowed:
		return true
	}
	return false
}
