package amqp

import (
	"errors"
	"fmt"
	"regexp"
	"sort"
	"strings"

	amqp091 "github.com/onceler/onceler/internal/amqp091"

	"github.com/onceler/onceler/internal/clip"
)

// Errors that callers act on. Match them with errors.Is.
var (
	// ErrStaleDelivery: the channel the delivery came on is gone, so its
	// delivery tag means nothing any more. The broker requeues the message
	// and delivers it again; nothing was acknowledged.
	ErrStaleDelivery = errors.New("amqp: stale delivery: its channel is closed, the broker will redeliver it")
	// ErrAlreadySettled: Ack, Nack or Reject was already called for this
	// delivery. Nothing was sent (a second ack would close the channel).
	ErrAlreadySettled = errors.New("amqp: delivery already acknowledged or rejected")
	// ErrNacked: the broker refused the publish (negative confirm), e.g. a
	// full queue with overflow reject-publish. The message was not stored.
	ErrNacked = errors.New("amqp: publish nacked by the broker")
	// ErrReturned: a mandatory publish could not be routed to any queue.
	// The error is a *ReturnedError with the broker's reply.
	ErrReturned = errors.New("amqp: mandatory publish returned unroutable")
	// ErrUnconfirmed: the publish was sent but its channel closed, or the
	// caller's context ended, before the broker confirmed it. The message
	// may or may not be stored: publishing again is the safe answer when
	// duplicates are harmless.
	ErrUnconfirmed = errors.New("amqp: publish outcome unknown: no confirm received")
	// ErrClosed: the Publisher was closed.
	ErrClosed = errors.New("amqp: publisher closed")
	// ErrNotFound: a passive declare, a publish or a get named an exchange
	// or queue that does not exist (404 NOT_FOUND).
	ErrNotFound = errors.New("amqp: not found")
	// ErrPrecondition matches every *PreconditionError.
	ErrPrecondition = errors.New("amqp: precondition failed")
	// ErrAccessRefused: the user may not use the resource (403).
	ErrAccessRefused = errors.New("amqp: access refused")
	// ErrConfig: the Config cannot work (bad URL, unreadable TLS files).
	ErrConfig = errors.New("amqp: invalid configuration")
	// ErrConsumerTimeout: the broker closed the consuming channel because
	// a delivery stayed unacknowledged longer than its consumer_timeout
	// (406 PRECONDITION_FAILED "delivery acknowledgement on channel N timed
	// out"). Every delivery unacknowledged on that channel goes back to the
	// queue and is delivered again; Consumer.Run logs it, naming the
	// setting, and reconnects.
	ErrConsumerTimeout = errors.New("amqp: delivery acknowledgement timed out (the broker's consumer_timeout)")
	// ErrCancelled: the broker cancelled the consumer (its queue was
	// deleted); Run reconnects and declares again.
	ErrCancelled = errors.New("amqp: consumer cancelled by the broker")
	// ErrRefused matches every *RefusedError: a publish or declare refused
	// for what it asks, which sending again can never make succeed.
	ErrRefused = errors.New("amqp: refused")
	// ErrTooLong: a name or property is longer than the 255 bytes of an
	// AMQP short string (exchange, routing key, queue, correlation_id,
	// reply_to, a header name). Refused before sending.
	ErrTooLong = errors.New("amqp: longer than an AMQP short string (255 bytes)")
	// ErrFrameTooLarge: a message's properties and headers do not fit in
	// one frame of the negotiated frame_max. Refused before sending.
	ErrFrameTooLarge = errors.New("amqp: properties and headers larger than a frame")
)

// RefusedError is a publish (or a declare before one) that the broker, or
// amqp091-go before sending, refuses for what it is: an exchange that does
// not exist (404), a reserved or forbidden name (403), a direct reply-to
// address the broker cannot read (it closes the connection, 541), a name or
// property over 255 bytes, properties larger than a frame. Sending it again
// gives the same answer; a lost connection is never a RefusedError.
// errors.Is(err, ErrRefused) is true for it; Unwrap gives the cause
// (ErrNotFound, ErrAccessRefused, a *PreconditionError, ErrTooLong,
// ErrFrameTooLarge, or the broker's *amqp091.Error).
type RefusedError struct {
	// Op is "publish" or "declare queue".
	Op string
	// Exchange and RoutingKey are the publish's (RoutingKey is the queue's
	// name for a declare), cut for display.
	Exchange, RoutingKey string
	// Code is the broker's reply code, 0 when refused before sending.
	Code int
	// Reason says why, bounded in length.
	Reason string
	// Err is the cause.
	Err error
}

func (e *RefusedError) Error() string {
	code := ""
	if e.Code != 0 {
		code = fmt.Sprintf(" (%d)", e.Code)
	}
	if e.Op != "publish" {
		return fmt.Sprintf("amqp: %s %q refused%s: %s", e.Op, e.RoutingKey, code, e.Reason)
	}
	return fmt.Sprintf("amqp: publish to exchange %q routing key %q refused%s: %s", e.Exchange, e.RoutingKey, code, e.Reason)
}

// Is makes errors.Is(err, ErrRefused) true.
func (e *RefusedError) Is(target error) bool { return target == ErrRefused }

// Unwrap returns the cause.
func (e *RefusedError) Unwrap() error { return e.Err }

// IsPermanent reports whether err is a *RefusedError: the broker refused
// this publish (or the declare of its queue) for what it is, and publishing
// it again can never succeed. A lost connection, a missing confirm, a nack
// (a full queue) or an unroutable return are not permanent.
func IsPermanent(err error) bool { return errors.Is(err, ErrRefused) }

// maxShown bounds names quoted in a RefusedError.
const maxShown = 128

// shown cuts s for an error message.
func shown(s string) string { return cut(s, maxShown) }

// cut returns s cut to about n bytes at a rune boundary, saying how long it
// was.
func cut(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return fmt.Sprintf("%s...(%d bytes)", clip.Prefix(s, n), len(s))
}

func refused(op, exchange, key string, code int, reason string, err error) *RefusedError {
	return &RefusedError{Op: op, Exchange: shown(exchange), RoutingKey: shown(key), Code: code,
		Reason: cut(reason, 512), Err: err}
}

// PreconditionError reports a 406 PRECONDITION_FAILED answer to a declare:
// the queue or exchange exists with other flags or arguments than declared.
// errors.Is(err, ErrPrecondition) is true for it.
type PreconditionError struct {
	// Kind is "queue" or "exchange".
	Kind string
	// Name is the queue or exchange declared.
	Name string
	// Declared describes what was asked, e.g. "durable=true auto_delete=false
	// args={x-queue-type: quorum}".
	Declared string
	// Arg is the property that differs as the broker names it (e.g.
	// "durable", "x-queue-type"), when its message says.
	Arg string
	// Received and Current are the declared and existing values of Arg as
	// the broker quotes them, when its message says.
	Received, Current string
	// Reason is the broker's full reply text.
	Reason string
}

func (e *PreconditionError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "amqp: %s %q exists with other properties than declared (%s)", e.Kind, e.Name, e.Declared)
	if e.Arg != "" {
		fmt.Fprintf(&b, ": %s differs: declared %s, broker has %s", e.Arg, e.Received, e.Current)
	}
	fmt.Fprintf(&b, "; broker said: %s; declare it the same way or set Passive", e.Reason)
	return b.String()
}

// Is makes errors.Is(err, ErrPrecondition) true.
func (e *PreconditionError) Is(target error) bool { return target == ErrPrecondition }

// ReturnedError is the broker's basic.return for a mandatory publish.
// errors.Is(err, ErrReturned) is true for it.
type ReturnedError struct {
	Exchange, RoutingKey string
	Code                 int
	Text                 string
}

func (e *ReturnedError) Error() string {
	return fmt.Sprintf("amqp: mandatory publish to exchange %q with routing key %q returned: %d %s",
		e.Exchange, e.RoutingKey, e.Code, e.Text)
}

// Is makes errors.Is(err, ErrReturned) true.
func (e *ReturnedError) Is(target error) bool { return target == ErrReturned }

// inequivalent matches RabbitMQ's 406 text, e.g. "PRECONDITION_FAILED -
// inequivalent arg 'durable' for queue 'q' in vhost '/': received 'true' but
// current is 'false'".
var inequivalent = regexp.MustCompile(`inequivalent arg '([^']*)' for .*: received (.*) but current is (.*)$`)

// brokerError returns the *amqp091.Error in err, if any.
func brokerError(err error) *amqp091.Error {
	var ae *amqp091.Error
	if errors.As(err, &ae) {
		return ae
	}
	return nil
}

// isConsumerTimeout reports whether e is RabbitMQ closing a channel at its
// consumer_timeout: 406 with "delivery acknowledgement on channel N timed
// out" (3.8.15 and later) or "consumer ack timed out on channel N" (before).
func isConsumerTimeout(e *amqp091.Error) bool {
	return e != nil && e.Code == amqp091.PreconditionFailed && strings.Contains(e.Reason, "timed out") &&
		strings.Contains(e.Reason, "ack")
}

// declareError turns a failed declare into our error types.
func declareError(err error, kind, name, declared string) error {
	ae := brokerError(err)
	if ae == nil {
		return fmt.Errorf("declare %s %q: %w", kind, name, err)
	}
	switch ae.Code {
	case amqp091.PreconditionFailed:
		pe := &PreconditionError{Kind: kind, Name: name, Declared: declared, Reason: ae.Reason}
		if m := inequivalent.FindStringSubmatch(ae.Reason); m != nil {
			pe.Arg, pe.Received, pe.Current = m[1], m[2], m[3]
		}
		return pe
	case amqp091.NotFound:
		return fmt.Errorf("declare %s %q: %w: %s", kind, name, ErrNotFound, ae.Reason)
	case amqp091.AccessRefused:
		op := "declare " + kind
		if kind == "binding of queue" {
			op = "bind queue"
		}
		if declared != "passive" {
			if acc := AccessRefusal(op, err); acc != nil && acc.Kind != "" {
				return acc
			}
		}
		return fmt.Errorf("declare %s %q: %w: %s", kind, name, ErrAccessRefused, ae.Reason)
	}
	return fmt.Errorf("declare %s %q: %w", kind, name, err)
}

// describeDeclare renders declared flags and arguments for error messages.
func describeDeclare(durable, autoDelete bool, args map[string]any) string {
	s := fmt.Sprintf("durable=%t auto_delete=%t", durable, autoDelete)
	if len(args) == 0 {
		return s
	}
	keys := make([]string, 0, len(args))
	for k := range args {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s: %v", k, args[k])
	}
	return s + " args={" + strings.Join(parts, ", ") + "}"
}

// IsTopologyError reports whether err says the declared queues or exchanges
// conflict with the broker's (406), are missing for a passive declare (404),
// are not permitted (403), or the configuration is invalid: errors that
// retrying does not cure, so Consumer.Run returns them.
func IsTopologyError(err error) bool {
	return errors.Is(err, ErrPrecondition) || errors.Is(err, ErrNotFound) ||
		errors.Is(err, ErrAccessRefused) || errors.Is(err, ErrConfig)
}
