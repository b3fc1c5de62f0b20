// Package amqp is onceler's thin adapter over github.com/rabbitmq/amqp091-go
// (a patched copy: see Header tables the library cannot read): it owns connecting with backoff, reconnecting, kombu-compatible topology,
// QoS, late acknowledgement bound to the channel a delivery came on, and
// publishing with confirms.
//
// # Two connections
//
// A Consumer and a Publisher each own a connection. RabbitMQ's memory and
// disk alarms block connections that publish; keeping consumption on a
// connection that never publishes means acknowledgements keep flowing while
// publishing waits for the alarm to clear. Both name their connection
// (Config.Name plus " consume" or " publish") so an operator can find them
// in the management UI or with rabbitmqctl list_connections.
//
// # The reconnect model
//
// amqp091 does not reconnect (its experimental recovery is not used here);
// this package does, in one place per role:
//
//   - Consumer.Run loops over sessions. A session dials (TCP, TLS, AMQP
//     handshake, heartbeats negotiated, default 10s), makes sure every
//     queue exists (see Queues), opens one channel, sets basic.qos to the remembered
//     prefetch and starts one consumer per queue. It ends at the first sign
//     of loss: the connection or channel closing, the delivery stream ending,
//     or the broker cancelling a consumer (its queue was deleted). Run then
//     waits a jittered exponential backoff (Config.MinBackoff to MaxBackoff)
//     and starts the next session. The backoff resets only after a session
//     that consumed for at least MaxBackoff: a loss that comes back as soon
//     as consuming starts waits longer each time. Errors no
//     retry can cure, a missing queue whose arguments the broker refuses
//     (406 PRECONDITION_FAILED, a *PreconditionError quoting it), a passive
//     declare of a missing queue, a refused access, are returned by Run.
//     A channel the broker closed at its consumer_timeout (a delivery
//     unacknowledged for longer) is ErrConsumerTimeout: Run logs a warning
//     naming the setting and reconnects.
//   - Publisher connects on first use and again whenever its session died,
//     one dial at a time, with the same backoff. A publish whose frame could
//     not be written because the connection was down is sent again on the
//     next connection; a publish that was written but not confirmed when the
//     channel died reports ErrUnconfirmed, since only the caller knows
//     whether sending it twice is harmless.
//
// Every Notify* channel registered with amqp091 is buffered and drained
// until amqp091 closes it: a full notification channel would stall
// amqp091's reader goroutine.
//
// # Header tables the library cannot read
//
// amqp091-go reads a message's header table inside its connection's frame
// reader, and closes the connection on a table it refuses: py-amqp's field
// type L (how Celery's client writes an integer beyond 32 bits), more than
// 8,192 entries in one table or array, nesting deeper than 32. The broker
// then redelivers the message to the next connection, which it closes too:
// the queue stalls behind one message, and nothing above the library ever
// sees it to quarantine it.
//
// This package therefore imports internal/amqp091, a copy of amqp091-go
// v1.16.0 with a small patch to its reader (PATCHES.md there): L is read as
// the signed 64-bit integer py-amqp writes, and a refused table costs the
// message its headers, not the connection. The table's length prefix keeps
// the frame in step, so the message is delivered with Headers nil and
// Delivery.HeadersError saying why, every other property intact; the
// decoder refuses it and the worker quarantines it and answers its caller.
// The limits stay: they bound what a small frame costs in memory.
//
// A patched copy was chosen over the other ways to keep the connection: a
// proxy or net.Conn wrapper that parses and rewrites every frame would
// duplicate the reader on every byte (and sit under TLS, or re-implement
// it); checking messages out of band cannot help, as the library fails
// before any delivery exists. It is an internal package rather than a go.mod
// replace directive because a replace applies only when this module is the
// main module: binaries that import onceler's packages to serve their own
// tasks would silently get the unpatched reader.
//
// # Why stale delivery tags are never acknowledged
//
// A delivery tag is a sequence number of one channel. After a reconnect the
// new channel numbers its deliveries from 1 again, so tag 7 of the old
// channel names some other message on the new one: acknowledging it there
// would remove a message that was never processed, and a tag the new channel
// has not issued closes the channel with 406. Meanwhile the broker has
// already put every unacknowledged message of the dead channel back in its
// queue (redelivered=true), so it will be delivered again anyway.
//
// Each Delivery therefore keeps a pointer to the state of the channel it
// came on, never to "the current channel". Once that channel is gone (its
// generation is marked closed before the channel is closed), Ack, Nack and
// Reject send nothing and return ErrStaleDelivery; the message comes back
// and the idempotency record decides what its second delivery does. A
// Delivery also refuses a second Ack (ErrAlreadySettled) instead of letting
// a double ack close the channel under every other delivery in flight.
//
// # Coalesced acknowledgements
//
// Tags are consecutive on a channel, so Ack answers a run of settled
// deliveries with one basic.ack multiple=true: the caller that finds no send
// in progress sends for everyone who acked meanwhile. A multiple ack only
// ever covers the unbroken run of explicitly settled tags from the lowest
// tag not yet settled, so a delivery still running (or never handed out)
// is never acknowledged on its behalf. An ack above such a gap waits for it
// to close, at most 20 ms and while no more than half the prefetch window
// waits, then goes out on its own. Nack and Reject are sent at once and
// then counted as settled, so a later multiple ack follows them on the
// channel. Waiting acks are sent before the channel closes; those of a
// channel that died are lost with it, and the broker redelivers their
// messages to be answered from the record.
//
// # Queues
//
// CeleryQueue(name) describes what kombu declares for a Celery queue: a
// durable, non-auto-delete queue, a durable direct exchange of the same name
// and a binding with the queue name as routing key.
//
// A queue that exists is served as it is: its flags and arguments (a
// priority queue's x-max-priority, a dead-letter exchange, a message TTL,
// x-queue-type, ...) are the business of the application that declared it,
// typically with kombu.Queue(..., queue_arguments={...}) in its task_queues.
// On every connect the consumer checks each queue with a passive
// queue.declare on a side channel (a missing queue closes that channel, not
// the one it consumes on). A queue that exists is never declared with other
// arguments than its own, so there is no 406 "inequivalent arg"; its
// exchange is declared only when missing, and the binding Celery makes is
// made again (a no-op when it exists). A missing queue is declared with
// QueueSpec.Durable, AutoDelete, Args, and x-queue-type quorum when Quorum
// is set (CeleryQuorumQueue), then bound.
//
// The consumer learns the arguments of a queue that exists, since how to
// consume it depends on them, and Consumer.Queues reports them (the worker's
// answer to 'celery inspect active_queues'). AMQP 0-9-1 has no method that
// reads them, but RabbitMQ answers a declare whose flags or arguments differ
// from the queue's with 406 naming the first one that differs and its
// current value; declaring again on a side channel with that value, until
// the broker accepts, gives every flag and argument it compares, which are
// those it acts on. Each refusal is a channel error in the broker's log.
// The next connect starts from what was learned, so an unchanged queue is
// accepted at once. A user without the configure permission on the queue is
// not told; the configured spec then stands for the queue.
//
// Consuming a quorum queue uses per-consumer prefetch (quorum queues refuse
// global QoS), and its redeliveries carry x-delivery-count
// (Delivery.DeliveryCount). That header is read only on a redelivery from a
// quorum queue, as found (or, for a passive spec, as the spec says: Quorum,
// or x-queue-type in Args): a classic queue passes a producer's header
// through untouched, and a first delivery was not delivered before.
// QueueSpec.Passive only checks that the queue exists, for queues managed
// by someone else.
//
// A priority queue (x-max-priority) hands its ready messages to consumers
// highest priority first. Messages already handed over, up to the prefetch
// count, are not reordered by a later message of higher priority: with a
// prefetch of n, a high-priority message may wait behind up to n messages
// already delivered. The consumer hands deliveries on in the order they
// arrive.
//
// # Publishing
//
// Publish uses publisher confirms on one channel shared by all callers:
// amqp091 holds the channel's lock only while it writes the frames, then
// each caller waits for its own deferred confirm, so many publishes are in
// flight at once. With PublishOptions.Mandatory, a message that no queue
// takes is returned by the broker before it is confirmed; Publish matches
// the return to the message by its message_id and fails with a
// *ReturnedError (ErrReturned). A negative confirm is ErrNacked. While the
// broker blocks the connection (resource alarm) Publish waits, bounded by
// its context; PublishOptions.Timeout is a bound that does not run while
// the block lasts, so that a publish the broker has not read yet is not
// given up and sent again as a second copy. Publishing to a named exchange
// checks once per connection, on a side channel, that the exchange exists
// (ErrNotFound otherwise), since a publish to a missing exchange would
// close the shared channel.
//
// Publisher.Inspect walks a queue with basic.get for operator tools: list,
// move (republish, then Remove) or drop quarantined messages.
//
// # URLs and secrets
//
// Config.URL takes Celery's spellings: amqp://, pyamqp://, amqps://, and
// "amqp://host:5672//" for vhost "/". Several URLs separated by ';' (or
// Config.URLs) are a failover list for the nodes of one cluster: each
// Consumer and Publisher connects to one URL at a time and moves on to the
// next after a failed attempt or a lost connection. The password never
// appears in logs or errors: RedactURL masks it (each URL of a list), and
// URL parse errors, which quote the URL, are not passed on.
package amqp
