// Package tasks is onceler's user-facing API: typed Celery task handlers with
// their operation key, effect mode and stale-claim policy, and the worker
// that consumes, claims, runs, completes, replies and acknowledges.
//
// # Tasks
//
// A task is declared with a Task[A] value and added to a Registry with
// Register. A is a struct: its exported fields bind the Celery args by
// position (declaration order) and the kwargs by name (`celery:"name"` tag,
// else the json tag, else the field name in snake_case). A field is required
// unless it is a pointer or tagged optional. A missing, unexpected or wrongly
// typed argument is an *ArgumentError (errors.Is ErrBadArguments) that names
// the argument but never its value.
//
//	type ChargeArgs struct {
//	    OrderID string `celery:"order_id"`
//	    Cents   int64  `celery:"cents"`
//	}
//	err := tasks.Register(reg, tasks.Task[ChargeArgs]{
//	    Name:   "billing.charge",
//	    Mode:   tasks.ModeOutside,
//	    Key:    func(a ChargeArgs) (string, error) { return a.OrderID, nil },
//	    Policy: tasks.PolicyLookup,
//	    Lookup: findCharge,
//	    Run:    charge,
//	})
//
// The operation key names the business operation the effect belongs to. Key
// derives it from the arguments; a producer's `idempotency_key` header wins
// when present. Registering a task that touches the outside world or the
// database without Key is an error: the Celery task id is not an operation
// key (a producer's retry or a user's double click makes a new one).
//
// # Modes
//
//   - ModePure: no record; every delivery runs the task.
//   - ModeSameDB: RunTx gets a pgx.Tx in which the record's claim, the task's
//     effect and the completion commit together. Exactly once, no lease
//     needed: a crash rolls everything back and the redelivery runs again.
//     A task whose effect is one statement returns it from RunStmt instead
//     (a Stmt): under load the statements of a transaction group go to the
//     database together, in one round trip.
//   - ModeOutside: the claim commits first; Run gets Call.Reference (task
//     name and operation key) to hand to the outside system as its
//     idempotency reference. While Run runs, the claim's lease is renewed;
//     if renewal fails the task's context is cancelled (cause
//     idempotency.ErrLeaseLost) and its outcome is not recorded.
//
// # Stale claims and policies
//
// An outside-mode claim whose lease lapsed without an outcome (its worker
// died or hung) is stale: nobody knows whether the effect happened. The next
// delivery of that operation applies the task's Policy:
//
//   - PolicyHold (default): record held, keep the message (DecodeHeld reads
//     it back), answer FAILURE OperationHeld, acknowledge, and wait for a
//     person (onceler resolve). Every later delivery of a held operation is
//     answered OperationHeld too, so that no caller waits in vain.
//   - PolicyRetry: take the claim over and run again (counted takeover).
//   - PolicySkip: record skipped and answer FAILURE OperationSkipped.
//   - PolicyLookup: take over and ask Lookup; found completes with the found
//     result, not found runs, an error applies Fallback (hold, retry, skip).
//
// # The pipeline
//
// The consumer hands each delivery to a bounded pool of Concurrency
// goroutines (prefetch defaults to Concurrency × 4). For each delivery:
//
//	decode            undecodable or pickle   -> FAILURE DecodeError / ContentDisallowed to reply_to
//	                                             (task id from the id header), quarantine, ack
//	delivery count    delivered too often     -> FAILURE WorkerLostError, quarantine, ack
//	registry          unknown task            -> FAILURE NotRegistered to reply_to, quarantine, ack
//	bind arguments    bad arguments           -> FAILURE TypeError to reply_to, quarantine, ack
//	workflow          chord, chain/chord step -> FAILURE NotImplementedError, quarantine, ack
//	revoked/expired                           -> REVOKED (TaskRevokedError) to reply_to, ack
//	eta in the future                         -> held unacknowledged until due (prefetch grows)
//	claim             completed               -> stored result to this reply_to, ack (duplicate)
//	                  in progress elsewhere   -> kept unacknowledged, looked at again (quickly,
//	                                             then at most every second, and when the lease lapses)
//	                  stale                   -> the task's policy
//	                  held / skipped          -> FAILURE OperationHeld / OperationSkipped, ack
//	                  fingerprint mismatch    -> FAILURE ValueError, quarantine, ack
//	                  first                   -> run (lease renewed), Complete or Fail
//	workflow          chain step, callbacks (success; once per operation), errbacks (failure)
//	reply             SUCCESS / FAILURE / RETRY to reply_to (confirmed publish)
//	ack
//
// In the source each stage has a file of its own, in this order:
// stage_decode.go, stage_bind.go, stage_due.go, stage_claim.go (with held.go
// for a delivery that waits while another run holds its operation's claim),
// stage_run.go, stage_settle.go, stage_answer.go and stage_ack.go;
// pipeline.go takes a delivery through them.
//
// # Acknowledgement rules
//
// A delivery is acknowledged only after the record says its outcome and the
// caller's result is published with a confirm; a quarantined message only
// after its copy is confirmed in the quarantine queue. When the outcome is
// unknown (the database did not answer, a commit may or may not have
// happened, the lease was lost), the delivery is not acknowledged: it is
// looked at again later, or given back to the broker, whose redelivery reads
// the record. An outside-system claim looked at again claims with the same
// token until its outcome is known, so a claim that committed while its
// answer was lost (the database restarting, say) is found to be the
// delivery's own and runs, instead of waiting out its lease and meeting the
// stale-claim policy. Deliveries whose channel died are never acknowledged on
// another channel: they are dropped from the pool, the broker redelivers
// them. Everything the pipeline does is correct if the process dies at any
// point: the record and the broker's redelivery carry the state.
//
// A task error is a failure (Fail: the operation may be claimed again by a
// later delivery), answered FAILURE and acknowledged, as Celery does. A
// same-database task (with the record or without it) whose transaction
// fails for the database's sake is not failed: a lost or terminated
// connection (SQLSTATE class 08, 57P01-57P03, a FATAL error, a network
// error, also when the task wrapped it), a serialization failure or
// deadlock, an unknown outcome. Nothing committed; the delivery is kept and
// runs again after a pause, and its caller gets no FAILURE. The
// caller sees the exception the task chose: PyError, ValueError, KeyError,
// TypeError; any other error is a builtins.Exception with the error text. A
// panic is the failure of that task only.
//
// # Quarantine
//
// Each consumed queue q has a durable queue "q.quarantine". A quarantined
// message keeps its body, properties and headers, and gets HeaderReason
// (x-onceler-reason: undecodable, unknown_task, bad_arguments,
// fingerprint_mismatch, poison, unsupported_workflow), HeaderDetail,
// HeaderQueue, HeaderTime and, for undecodable messages, HeaderDecodeReason.
// A message delivered more than Config.MaxAttempts times (x-delivery-count
// on quorum queues; on classic queues, a redelivered message whose
// operation was claimed that often, its Celery retries not counted) is
// quarantined as poison instead of crashing workers forever (on a quorum
// queue with x-delivery-limit, the delivery whose x-delivery-count reaches
// the limit, the broker's last, is not run but republished with its
// deliveries so far in HeaderDeliveries, counted with the copy's); its
// caller gets
// FAILURE billiard.exceptions.WorkerLostError, as from Celery when the
// worker running a task dies. A same-database
// claim dies with its transaction when the worker crashes, so on classic
// queues each redelivery of a same-database message is counted in a
// committed statement of its own (idempotency CountAttempt; first
// deliveries count nothing), and a message redelivered more than
// MaxAttempts times whose operation is not completed is quarantined.
//
// # Retries and the record
//
// A task asks for a Celery retry by returning Call.Retry(countdown, cause)
// (Celery's self.retry); RetryPolicy.AutoRetry turns chosen errors into
// retries by themselves (autoretry_for), with RetryPolicy.Backoff giving
// exponential delays (Backoff × 2^retries, capped by BackoffMax, with full
// jitter unless NoJitter), as retry_backoff, retry_backoff_max and
// retry_jitter. For a retry the worker:
//
//  1. releases the claim (outside mode: idempotency Release, so the retried
//     message claims the operation again as a first claim, not a duplicate;
//     same-database mode: the transaction is rolled back, nothing is kept);
//  2. republishes the message with a confirm, to the queue it came from
//     through the default exchange: same task id, retries+1,
//     eta = now + countdown, everything else (args, chain, callbacks,
//     errbacks, time limits, expires, reply_to, headers) copied;
//  3. sends RETRY to the caller, then acknowledges.
//
// Call.Retries (the message's retries) reaches the task. When the retries
// are used up (RetryPolicy.MaxRetries, default 3; negative: none) the task
// fails instead, decided before anything is written: the record is failed,
// not released, and the caller gets the retry's cause, or
// celery.exceptions.MaxRetriesExceededError when it has none. Time limits,
// revocation, lease loss and shutdown are never retried automatically.
//
// # ETA, countdown and prefetch
//
// A message with an eta (countdown) in the future is held unacknowledged in
// memory until due (Worker.Scheduled lists them). The prefetch window grows
// by one for each held delivery and shrinks when it is released, as
// Celery's worker does, so that held deliveries never take the slots of
// immediate ones. On classic queues the window is the channel's global
// basic.qos, changed at once. Quorum queues have no global QoS: the worker
// restarts its consumers under the new per-consumer limit (the consumer's
// held deliveries stay unacknowledged on the channel); changes are
// serialized and the last one applies the latest count.
//
// RabbitMQ closes a channel whose oldest unacknowledged delivery is older
// than its consumer_timeout (30 minutes by default since 3.8.17), and every
// delivery unacknowledged on it returns to the queue. So that an ETA further
// away does not cost that, a delivery is held at most Config.MaxHold
// (default 25 minutes): then a copy of the message is published to the
// queue it came from (with a confirm) and the delivery acknowledged; the
// copy comes back as a fresh delivery and is held in its place. A crash
// between the two leaves two copies with the same task id, which the record
// answers (a pure task would run twice). If the broker closes the channel
// anyway (a consumer_timeout below MaxHold, a connection loss), nothing is
// lost: the held deliveries of the closed channel are dropped (the window
// shrinks back), their redeliveries are held again, and an operation that
// was running is answered from the record on its redelivery (a pure task
// runs again). Keep MaxHold below consumer_timeout.
//
// # Expires and revocation
//
// expires is checked on receipt and again before the task runs (after an
// ETA wait, or a wait in the pool): an expired message gets REVOKED with
// celery.exceptions.TaskRevokedError("expired") to the caller and is
// acknowledged without running. A message that expires before its ETA is
// held only until it expires. A revoked id (Worker.Revoke) is answered the
// same way with "revoked". The worker remembers revoked ids for
// Config.RevokedExpiry (3 h, as Celery's REVOKE_EXPIRES), at most the last
// 50,000.
//
// Revoke with terminate cancels a running task's context (cause
// ErrRevoked); its caller gets REVOKED (TaskRevokedError "terminated") and
// the delivery is acknowledged. A task that has not returned 100 ms later is
// abandoned as at the hard time limit (below, by mode): its caller is
// answered at once while its goroutine runs on. A same-database task without
// a time limit has no transaction guard and is not abandoned: it is waited
// for, and if it returns success anyway its outcome stands (committed,
// SUCCESS). A task that returns the cause after the revoke is REVOKED.
//
// # Time limits
//
// The soft time limit (Task.SoftTimeLimit, else the message's timelimit[1])
// cancels the task's context with cause ErrSoftTimeLimit; a task that
// returns the cause gives the caller billiard.exceptions.SoftTimeLimitExceeded
// (an ordinary failure: AutoRetry may retry it). At the hard limit
// (Task.TimeLimit, else timelimit[0]) the context is cancelled with cause
// ErrTimeLimit; a task that has not returned 100 ms later is abandoned: the
// caller gets FAILURE billiard.exceptions.TimeLimitExceeded and the delivery
// is acknowledged, as Celery does after killing the process. Go cannot stop
// a goroutine: the abandoned one runs on with its context cancelled, its
// result discarded, outside the Concurrency bound; Run waits for it, at most
// Config.Grace. By mode:
//
//   - Pure: nothing more.
//   - Same-database: the transaction is rolled back. The task's pgx.Tx is
//     guarded: from the abandonment on, its calls fail with pgx.ErrTxClosed
//     without touching the connection; a call in progress that ignores the
//     cancelled context is given a second, then the connection's socket is
//     closed under it (the server rolls back). Tx.Conn and Tx.LargeObjects
//     are outside the guard.
//   - Outside: the claim is no longer renewed, and the effect may still
//     happen: the task's stale-claim policy settles it at once, without
//     waiting for a delivery that may never come. Hold and lookup hold it
//     (a lookup could not see an effect still in flight), skip skips it,
//     retry fails it (claimable again: the rare duplicate that policy
//     accepts).
//
// # Workflows
//
// Chains, link callbacks and link_error errbacks are carried out as
// Celery's worker does (celery/app/trace.py, Backend.mark_as_failure):
//
//   - After a success, before SUCCESS goes to the caller: each link
//     callback is published with (result,) prepended; then the chain's next
//     step, embed.chain's last element, with (result,) prepended unless it
//     is immutable, the rest of the chain, its task id and reply_to from its
//     frozen options (so the final result reaches the original caller),
//     parent_id = this task and root_id = this task's root. Steps go to the
//     queue, exchange or routing key in their options, else Config.Routes,
//     else this delivery's queue for a task this worker serves, else
//     "celery"; a queue missing on the broker is declared as kombu does.
//     Steps (and Celery retries) are sent in the serializer the message came
//     in (json, msgpack or yaml), as a Python worker whose task_serializer
//     matches its callers' would send them: msgpack bytes stay bytes.
//   - After a failure: FAILURE with the same exception to every remaining
//     chain step with a task id (so that chain.get() raises), then each
//     errback is published with the failed task's id prepended.
//   - Published once: with a record, the ids of the steps published for a
//     completed operation are recorded (idempotency AddFollowups). A
//     duplicate delivery of the step (a redelivery, or the same operation
//     under a new task id) publishes only steps not recorded, so the rest of
//     a chain does not run twice. A crash between the publish and the
//     recording publishes the same messages (same task ids) again. Pure
//     tasks publish their steps on every run, as Celery does.
//
// A Go task runs as a member of a group: its result goes to its reply_to
// with its own id, which is all a group needs. A group as a step (the last
// step of a chain, a link callback, an errback) is published as its
// members, each with the result (or the failed id) prepended, group_id =
// the group's id and group_index; when a chain fails before such a group,
// its members' callers get the FAILURE too. Chord parts are joined as
// Celery's Redis and django-celery-results backends join them (with
// Config.ResultBackend redis:// or django-db+postgresql://; see
// docs/result-backends.md): the part that completes the header publishes
// the body once, with the results in header order, or gives its errbacks a
// ChordError. With rpc:// chord parts are refused, as in Celery, and so are
// chord bodies that are not a plain task signature, steps that are chains
// or chords, and a group followed by more chain steps (Celery makes that a
// chord): before the task runs, the caller and the rest of the chain get FAILURE
// NotImplementedError with the reason, errbacks are published, and the
// message is quarantined (ReasonUnsupported). Bad arguments fail along the
// chain the same way (TypeError).
//
// # Shutdown
//
// Cancelling Run's context stops consuming (the consumer cancels its
// subscriptions), gives waiting and scheduled deliveries back to the broker,
// and lets running tasks finish within Config.Grace; then their contexts are
// cancelled (cause ErrShutdown) and their deliveries given back. A
// same-database task's transaction rolls back. An outside task's claim is
// left stale (idempotency Store.Lapse ends its lease at once): whether the
// task reached the outside system is unknown, so the redelivery goes to
// the task's stale-claim policy, as after a crash, rather than running it
// again unasked. Nothing is acknowledged that did not finish. A second signal
// is the command's to handle (exit at once: the broker and the record make
// that safe too).
//
// # Observability
//
// Logs carry task, task_id, key and retries, never argument values (unless
// Config.LogArguments). Prometheus metrics, registered on Config.Metrics:
//
//	onceler_tasks_received_total{task}        task messages received
//	onceler_tasks_succeeded_total{task}       runs that succeeded
//	onceler_tasks_failed_total{task}          runs that failed
//	onceler_tasks_retried_total{task}         Celery retries requested
//	onceler_sidekiq_retry_outcomes_total{task,outcome} Sidekiq jobs handed to Sidekiq's retry: retried, dead, discarded
//	onceler_tasks_revoked_total{task}         revoked, expired or terminated
//	onceler_duplicates_suppressed_total{task} deliveries answered from the record
//	onceler_deferred_total{task}              deliveries deferred: operation in progress elsewhere
//	onceler_stale_claims_total{task,policy}   stale claims, by policy applied
//	onceler_held_total{task}                  deliveries of held operations
//	onceler_quarantined_total{reason}         messages moved to quarantine
//	onceler_workflow_steps_published_total{kind} chain steps, link callbacks, errbacks published
//	onceler_tasks_abandoned_total{task}       tasks abandoned (hard time limit, terminating revoke)
//	onceler_tasks_in_flight                   tasks running now
//	onceler_tasks_scheduled                   deliveries held until their ETA
//	onceler_task_duration_seconds{task}       run time histogram
//	onceler_claim_duration_seconds            claim latency histogram
//	onceler_broker_reconnects_total           consumer reconnects
//	onceler_claims_lapsed                     claims whose lease lapsed without an outcome (read at scrape)
//	onceler_memory_budget_bytes               Config.MemoryBudget
//	onceler_memory_charged_bytes              memory charged by the deliveries held
//	onceler_deliveries_waiting_memory         deliveries waiting, undecoded, for the budget
//	onceler_eta_requeued_total                due later, sent back: ETA holds fill half the budget
//	onceler_stalled                           1 while every slot is held without progress
//	onceler_memory_collections_total          collections run before a large decode
//	onceler_receive_failures_total            failed SQS receives and Sidekiq fetches, tried again
//
// Worker.HealthHandler serves /healthz (the worker runs) and /readyz (it is
// consuming, its database answers and it is not stalled: Worker.Stalled).
// docs/limits.md describes the memory budget and readiness.
//
// # Remote control and events
//
// A worker answers Celery's remote control ('celery inspect', 'celery
// control') and sends worker events (online, heartbeats, offline) as a
// Celery worker does, through a control.Controller of its own that runs
// with Run on a connection of its own to the broker, under the node name
// Config.Hostname ("onceler-<pid>@<host>" by default); Config.TaskEvents
// sends task events from the start (Celery's -E), Config.NoControl turns
// it all off (see package control). Without a Logger, the worker logs at
// info to standard error as the onceler command does.
//
// The Observer receives Celery's task
// events (task-received, task-started, task-succeeded, task-failed,
// task-retried, task-revoked) with Celery's fields, plus
// onceler_duplicate on answers from the record and onceler_key_sha256 (on
// the first event once the operation key is known; the task name, as in
// Celery, on the first event, task-received).
// task-succeeded carries runtime (seconds) and result (the Python repr of
// the result, at most 1024 bytes); task-failed and task-retried carry
// exception (its Python repr) and traceback (in Python's text shape: for a
// failure of the task function, its Go frames and error chain, see
// WithStack). task-received goes when a delivery is taken from the broker,
// before a task slot is free. When the Observer has a
// TaskEvents() bool method (control.Controller has), the worker asks it
// first and builds no event when it says no. The remote control gets them
// too while its task events are on.
// Registered, Active, Reserved, Scheduled, Revoke and Stats serve remote
// control.
package tasks
