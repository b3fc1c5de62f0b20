package tasks

// The transport seam: where the pipeline (pipeline.go) meets the broker its
// deliveries come from. The Worker holds a transport, which consumes and
// takes the worker's flow control; each job holds a delivery, through which
// the stages read, move and settle it. Nothing else in the pipeline names a
// broker's types for the job's own message. The worker's transport is
// RabbitMQ's (transport_amqp.go), with Config.Sidekiq Sidekiq's
// (transport_sidekiq.go, transport_sidekiq_worker.go), or with Config.SQS
// Amazon SQS's (transport_sqs.go).
//
// A transport's message reaches the stages in Celery's wire form
// (delivery.wire), which the decode stage decodes as it does any Celery
// message: the bind, claim, run and settle stages need nothing else. What
// the stages do to the delivery falls in a few kinds, one method each:
//
//   - settle: ack when answered, giveBack when not (it comes again);
//   - hold: nothing to call: an unsettled delivery stays the worker's
//     (an ETA not reached, a rate limit, an operation in progress elsewhere,
//     a record away) until it is settled or the transport takes it back
//     (stale);
//   - republish: a copy back to its queue, due at the message's ETA (a hold
//     cut at Config.MaxHold, room made in the memory budget), then ack;
//   - retry: the task's next try (Call.Retry, RetryPolicy), then ack;
//   - quarantine: kept aside with the reason, never run, then ack;
//   - keep: the form a held record keeps for replay (DecodeHeld);
//   - facts: where it came from (origin), whether it may have been
//     delivered before (redelivered), the transport's own count of its
//     deliveries (deliveryCount), whether it can still be settled (stale).
//
// Answering the caller is not the delivery's: the message names its reply
// queue (reply_to) or the result backend keeps the result by task id.

import (
	"context"
	"time"

	"github.com/onceler/onceler/celeryproto"
)

// transport brings deliveries to the worker and takes its flow control.
// The worker calls prepare once, then consume once; close once consume has
// returned and every delivery is settled or given back.
type transport interface {
	// prepare readies the broker before consuming (the AMQP transport
	// declares each queue's quarantine queue).
	prepare(ctx context.Context) error
	// consume hands each delivery to receive, which must not block, until
	// ctx is done; it returns nil then, or the error that stopped it
	// before. Deliveries not settled when it returns can still be settled
	// until close.
	consume(ctx context.Context, receive func(delivery)) error
	// ready reports whether it is consuming now.
	ready() bool
	// setPrefetch sets how many deliveries may be unsettled at once:
	// Config.Prefetch plus those held for their ETA.
	setPrefetch(n int) error
	// setWindowLimit caps that window for the memory budget (0: no cap).
	setWindowLimit(n int) error
	// fixedWindow reports whether the window must not be capped: a change
	// would let more deliveries in, not fewer (a quorum queue restarts its
	// consumers with a new window on top of what they hold).
	fixedWindow() bool
	// close releases the transport's connections.
	close() error
}

// delivery is one message as a transport delivered it. Its settling
// methods (ack, giveBack) are called at most once, and nothing else is
// called after them; republish, retry and quarantine put a copy elsewhere
// and leave the delivery unsettled (the caller acks it when they
// succeed). An error of theirs for which amqp.IsPermanent reports true (an
// *amqp.RefusedError) is a refusal of what was sent: trying again cannot
// succeed; any other error may pass.
type delivery interface {
	// wire is the message in Celery's wire form: what the decoder reads and
	// the memory budget charges. The same pointer for the delivery's life
	// (the budget keys its charges by it).
	wire() *celeryproto.Delivery
	// origin is where the delivery came from.
	origin() origin
	// redelivered reports whether the message may have been delivered
	// before: a run of it may have begun.
	redelivered() bool
	// deliveryCount is how many times the transport delivered the message
	// before, by its own count; 0 when it keeps none (the worker then
	// counts redeliveries itself where it must: dbfault.go).
	deliveryCount() int
	// deliveryLimit is the transport's own bound on deliveryCount: past a
	// delivery whose count reaches it, the transport drops or dead-letters
	// the message (a quorum queue's x-delivery-limit); 0 when none.
	deliveryLimit() int
	// passOn publishes a copy of the message to the queue it came from,
	// with HeaderDeliveries set to deliveries and without the transport's
	// own count, so that the transport starts counting it afresh; the
	// caller acknowledges the delivery once it succeeds. Only a transport
	// with a deliveryLimit is asked.
	passOn(ctx context.Context, deliveries int) error
	// stale reports whether the delivery can no longer be settled: the
	// transport has it back and delivers it again.
	stale() bool

	// ack settles the delivery as answered: the transport forgets it.
	ack() error
	// giveBack settles it unanswered: the transport delivers it again.
	giveBack() error

	// republish puts a copy back on the queue it came from, due at eta
	// (the message's ETA).
	republish(ctx context.Context, eta time.Time) error
	// retry sends next, the message's next try (its retries one more, its
	// ETA when to run it), which the task asked for with rr. An error
	// wrapping *encodeError: next cannot be sent at all.
	retry(ctx context.Context, next *celeryproto.Message, rr *RetryRequest) error
	// quarantine puts a copy aside, never to run, with ours (the
	// Header* values) beside the message's own headers.
	quarantine(ctx context.Context, ours map[string]any) error
	// keep is the form a held record keeps of the message, for replay
	// (DecodeHeld).
	keep() ([]byte, error)
}

// origin is where a delivery came from.
type origin struct {
	// Queue is the queue it was consumed from.
	Queue string
	// Exchange and RoutingKey are those it was published with (empty where
	// the transport has none).
	Exchange, RoutingKey string
	// Priority is its priority (0: none).
	Priority uint8
}

// encodeError is a message a transport cannot encode: sending it again
// cannot succeed.
type encodeError struct{ err error }

// Error implements error.
func (e *encodeError) Error() string { return e.err.Error() }

// Unwrap returns the encoder's error.
func (e *encodeError) Unwrap() error { return e.err }
