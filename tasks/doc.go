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
//     it back), acknowledge, and wait for a person (onceler resolve).
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
//	decode            undecodable or pickle   -> quarantine, ack
//	registry          unknown task            -> FAILURE NotRegistered to reply_to, quarantine, ack
//	bind arguments    bad arguments           -> FAILURE TypeError to reply_to, quarantine, ack
//	revoked/expired                           -> REVOKED (TaskRevokedError) to reply_to, ack
//	eta in the future                         -> held unacknowledged until due (prefetch grows)
//	claim             completed               -> stored result to this reply_to, ack (duplicate)
//	                  in progress elsewhere   -> kept unacknowledged, looked at again (quickly,
//	                                             then at most every second, and when the lease lapses)
//	                  stale                   -> the task's policy
//	                  fingerprint mismatch    -> FAILURE ValueError, quarantine, ack
//	                  first                   -> run (lease renewed), Complete or Fail
//	reply             SUCCESS / FAILURE / RETRY to reply_to (confirmed publish)
//	ack
//
// # Acknowledgement rules
//
// A delivery is acknowledged only after the record says its outcome and the
// caller's result is published with a confirm; a quarantined message only
// after its copy is confirmed in the quarantine queue. When the outcome is
// unknown (the database did not answer, a commit may or may not have
// happened, the lease was lost), the delivery is not acknowledged: it is
// looked at again later, or given back to the broker, whose redelivery reads
// the record. Deliveries whose channel died are never acknowledged on
// another channel: they are dropped from the pool, the broker redelivers
// them. Everything the pipeline does is correct if the process dies at any
// point: the record and the broker's redelivery carry the state.
//
// A task error is a failure (Fail: the operation may be claimed again by a
// later delivery), answered FAILURE and acknowledged, as Celery does. The
// caller sees the exception the task chose: PyError, ValueError, KeyError,
// TypeError; any other error is a builtins.Exception with the error text. A
// panic is the failure of that task only.
//
// # Quarantine
//
// Each consumed queue q has a durable queue "q.quarantine". A quarantined
// message keeps its body, properties and headers, and gets HeaderReason
// (x-onceler-reason: undecodable, unknown_task, bad_arguments,
// fingerprint_mismatch, poison), HeaderDetail, HeaderQueue, HeaderTime and,
// for undecodable messages, HeaderDecodeReason. A message delivered more than
// Config.MaxAttempts times (x-delivery-count on quorum queues; on classic
// queues, a redelivered message whose operation was claimed that often) is
// quarantined as poison instead of crashing workers forever.
//
// # Retries, ETA, expiry, time limits
//
// Call.Retry returns a RetryRequest: the claim is released, the message is
// republished with the same id, retries+1 and an eta, RETRY goes to the
// caller, and the original is acknowledged; past RetryPolicy.MaxRetries
// (default 3) the task fails with MaxRetriesExceededError (or the retry's
// cause). Messages with an ETA are held unacknowledged until due, and the
// prefetch window grows by one for each. Expired messages are REVOKED.
// The soft time limit (Task.SoftTimeLimit or the message's) cancels the
// task's context with cause ErrSoftTimeLimit; the hard limit cancels it with
// ErrTimeLimit and the caller gets billiard.exceptions.TimeLimitExceeded.
// Go cannot kill a goroutine: tasks must watch their context.
//
// # Shutdown
//
// Cancelling Run's context stops consuming (the consumer cancels its
// subscriptions), gives waiting and scheduled deliveries back to the broker,
// and lets running tasks finish within Config.Grace; then their contexts are
// cancelled (cause ErrShutdown), their claims released and their deliveries
// given back. Nothing is acknowledged that did not finish. A second signal
// is the command's to handle (exit at once: the broker and the record make
// that safe too).
//
// # Crash injection
//
// Config.Crash (FromEnv reads ONCELER_CRASH_AT and ONCELER_CRASH_TASK) makes
// the process SIGKILL itself the first time a task reaches after_claim,
// after_effect or before_ack, for testing recovery.
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
//	onceler_tasks_revoked_total{task}         revoked, expired or terminated
//	onceler_duplicates_suppressed_total{task} deliveries answered from the record
//	onceler_deferred_total{task}              deliveries deferred: operation in progress elsewhere
//	onceler_stale_claims_total{task,policy}   stale claims, by policy applied
//	onceler_held_total{task}                  deliveries of held operations
//	onceler_quarantined_total{reason}         messages moved to quarantine
//	onceler_tasks_in_flight                   tasks running now
//	onceler_tasks_scheduled                   deliveries held until their ETA
//	onceler_task_duration_seconds{task}       run time histogram
//	onceler_claim_duration_seconds            claim latency histogram
//	onceler_broker_reconnects_total           consumer reconnects
//
// Worker.HealthHandler serves /healthz (the worker runs) and /readyz (it is
// consuming and its database answers). The Observer receives Celery's task
// events (task-received, task-started, task-succeeded, task-failed,
// task-retried, task-revoked, task-rejected) with Celery's fields, plus
// onceler_duplicate on answers from the record and onceler_key_sha256.
// Registered, Active, Reserved, Scheduled, Revoke and Stats serve remote
// control.
package tasks
