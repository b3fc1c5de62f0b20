package amqp

import (
	"errors"
	"fmt"
	"regexp"
	"sort"
	"strings"

	amqp091 "github.com/onceler/onceler/internal/amqp091"
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
	// ErrCancelled: the broker cancelled the consumer (its queue was
	// deleted); Run reconnects and declares again.
	ErrCancelled = errors.New("amqp: consumer cancelled by the broker")
)

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
