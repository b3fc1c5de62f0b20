// Package control makes a onceler worker visible and controllable the way a
// Celery worker is: it sends Celery events on the celeryev exchange (what
// `celery events` and Flower read) and answers remote-control requests on
// celery.pidbox (what `celery inspect` and `celery control` send).
//
// # Wiring
//
// A tasks.Worker runs a Controller of its own, for as long as its Run runs,
// on a connection of its own to the worker's broker (same URL and TLS) and
// under the worker's node name (tasks.Config.Hostname, "onceler-<pid>@<host>"
// by default); tasks.Config.TaskEvents is Celery's -E and
// tasks.Config.NoControl turns it off, as the onceler command's --events and
// --no-control do. tasks.Worker.Controller returns it.
//
// A Controller configured otherwise (another heartbeat, event buffer or
// backoff) runs beside a worker that runs none: it wraps the worker through
// the small Worker interface (a *tasks.Worker is one) and is itself the
// worker's tasks.Observer:
//
//	node, _ := control.NodeName(hostnameFlag)     // "onceler-<pid>@<host>" by default
//	ctl, err := control.New(nil, control.Config{URL: brokerURL, NodeName: node, Heartbeat: 5 * time.Second})
//	w, err := tasks.NewWorker(reg, tasks.Config{Hostname: node, Observer: ctl, NoControl: true, ...})
//	ctl.SetWorker(w)
//	go ctl.Run(ctx)                                // until ctx is done
//
// # Events
//
// worker-online is sent when the controller first connects, worker-heartbeat
// every Config.Heartbeat (2 s, as Celery) and worker-offline when Run's
// context ends, whatever the task-event setting: a receiver's
// celery.events.State counts the node alive while heartbeats arrive within
// twice their frequency. Task events (task-received, task-started,
// task-succeeded, task-failed, task-retried, task-revoked, task-rejected)
// are sent only when Config.TaskEvents is set (Celery's -E) or after an
// enable_events command, until disable_events.
//
// Every event carries Celery's common fields (type, hostname, pid, clock,
// timestamp, utcoffset); the worker supplies the per-type fields. onceler
// adds two fields that Celery's readers keep as plain attributes:
// celeryproto.FieldDuplicate (the delivery was a duplicate answered from the
// record) and celeryproto.FieldKeyHash (celeryproto.KeyHash of the operation
// key, never the key itself).
//
// Publishing never slows a task: Event stamps the event and puts it in a
// bounded buffer (Config.EventBuffer); a single publisher goroutine sends
// them, batching task events (up to 128 per message, gathered for at most
// Config.EventLinger, 50 ms) on routing key
// task.multi, the form Celery's own worker uses for buffered task events.
// When the buffer is full, or the broker is unreachable, events are dropped
// and counted (inspect stats: events.dropped). Events are transient in Celery
// too.
//
// # Cost
//
// With task events on, a task pays for three Event calls (a timestamp, a
// clock tick and a buffered channel send each; the publisher is never woken
// by them) plus the worker's building of the field maps. Encoding
// (celeryproto.AppendEvent, no allocation, about 1 µs per event on the
// 2-core test machine) and publishing (one message per up to 128 events)
// run on the publisher goroutine. BenchmarkWorkerEvents and
// BenchmarkWorkerEventsAB measure it with the real worker: CPU profiles put
// the controller at about 4 µs and the worker's event fields at about 2.5 µs
// of a pure task's 65-75 µs of process CPU, and running a worker with and one
// without events side by side gave a median throughput ratio (on/off) of
// 1.05 over 15 runs: below the noise of the shared machine.
//
// # Remote control
//
// The controller consumes its own queue "<node>.celery.pidbox" (auto-delete,
// x-expires 10 s, x-message-ttl 300 s, no acknowledgements) bound to the
// fanout exchange celery.pidbox, both declared with kombu's flags, and
// replies on the request's reply exchange (reply.celery.pidbox, direct)
// with the request's routing key and ticket. A request is handled when its
// destination names the node, or its pattern matches (glob or pcre), or it
// names no one. Commands: ping, stats, active, reserved, scheduled,
// registered, active_queues, query_task, conf, revoke (one id or a list;
// terminate cancels the
// running task's context), terminate, revoked, enable_events,
// disable_events, heartbeat, clock, hello (Celery's mingle: revoked ids are
// exchanged) and shutdown (Config.Shutdown). Inspect active lists argsrepr
// and kwargsrepr, what the producer already put on the wire, not argument
// values.
//
// Revoked ids are kept in a bounded set with expiry (Revoked: 50 000 ids,
// 3 hours, as Celery) and handed to the worker, which answers a revoked task
// REVOKED (TaskRevokedError) on receipt and before it runs. A revoke may name
// any number of ids and takes time linear in them (a million task ids, a
// 40 MB message, is answered in about a second): the set keeps the last 50 000
// given, as adding them all to a set of 50 000 would; terminate still reaches
// a running task named anywhere in the list. Unlike Celery's, the reply lists
// the first ids only, up to 4 KiB of them, and counts the rest ("tasks a, b
// and 99998 more flagged as revoked"); the log line gives the count and the
// first 10 ids.
//
// Commands are handled one at a time on a goroutine of their own:
// heartbeats and the end of Run's context never wait for a command (Run
// returns once the command in hand ends; a revoke stops early at shutdown).
//
// # Connection
//
// The controller uses amqp091-go directly on one connection of its own,
// separate from the worker's consuming and publishing connections: the
// pidbox queue is consumed without acknowledgements and events are
// published without confirms, which the amqp package's late-ack consumer and
// confirming publisher are not made for. Run reconnects with jittered
// exponential backoff (Config.MinBackoff..MaxBackoff); after a reconnect it
// redeclares the queue and sends a heartbeat at once.
package control
