// Package replay is onceler's replay suite: it proves, against real
// RabbitMQ, PostgreSQL and worker processes, that a task's effects happen as
// often as its mode and stale-claim policy promise when messages are
// duplicated, raced and redelivered after crashes. Point it at a task of your
// own in a binary of your own, as a conformance suite:
//
//	func TestRefundReplay(t *testing.T) {
//		bin, err := replay.Build(ctx, t.TempDir(), "example.com/billing/cmd/worker")
//		...
//		replay.Run(t, replay.Target{
//			Binary:    bin,
//			Task:      "billing.refund",
//			Mode:      tasks.ModeSameDB,
//			Arguments: func(op string) ([]any, map[string]any) { return []any{op, 1250}, nil },
//			Effects:   countRefunds, // rows in the refunds table for order op
//		})
//	}
//
// Run it a second time with Target.NoRecord set: then every scenario must
// show the duplicate the record exists to prevent, and the test fails if it
// does not (a scenario that passes without the record tests nothing).
//
// # The worker binary
//
// The suite starts Binary with Command as arguments and these environment
// variables, which the onceler command reads (every flag has one), and so
// does a binary of your own made with cmd.Main (Command {"worker"}). Crash
// injection and running without the record are no part of package tasks'
// API: a binary wired with tasks.NewWorker itself cannot honour
// ONCELER_CRASH_AT or ONCELER_NO_RECORD, and so cannot run the crash
// scenarios or the run with Target.NoRecord; make it with cmd.Main.
//
//	ONCELER_BROKER_URL     the broker
//	ONCELER_DATABASE_URL   the database, with application_name = the node name
//	ONCELER_SCHEMA         the record's schema (the suite migrates it first)
//	ONCELER_QUEUES         the test's own queue (declared as kombu declares it)
//	ONCELER_LEASE          the claim lease, DefaultLease (2 s) by default
//	ONCELER_HOSTNAME       a unique node name, also the broker connection name
//	ONCELER_CONCURRENCY, ONCELER_PREFETCH
//	ONCELER_NO_RECORD      true when Target.NoRecord
//	ONCELER_QUORUM         true when Config.Quorum (a quorum queue)
//	ONCELER_CRASH_AT, ONCELER_CRASH_TASK   crash injection: the point (after_claim,
//	                       after_effect, before_ack, chord_joined) and the task
//	ONCELER_GRACE, ONCELER_LOG_FORMAT=json
//
// To run the workers as a restricted PostgreSQL role (a worker's
// privileges only, as in production), set Target.WorkerDatabaseURL to a URL
// naming that role and Target.Prepare to grant it, in each scenario's
// schema, what 'onceler migrate --grant-to' grants
// (idempotency.GrantStatements of idempotency.WorkerPrivileges, or
// Env.Store.Grant) and what its tasks need on their own tables; Command
// then must not migrate ({"worker"}): the suite migrates as DatabaseURL's
// role.
//
// A worker counts as started when the queue has one more consumer. Every
// process is killed when the test ends, whatever happened; on failure its
// log is printed.
//
// # Scenarios
//
// Each scenario is a subtest with its own queue, record schema and worker
// processes. Messages are Celery protocol 2, built by celeryproto.EncodeTask
// as a Python producer with the rpc result backend sends them (reply_to the
// test's reply queue, correlation id the task id); results are collected from
// the reply queue by correlation id, or with Target.ResultBackend (a redis://
// URL the workers get as ONCELER_RESULT_BACKEND) read from Redis, one per
// task id.
//
//   - repeated: three operations, each message (same task id) delivered three
//     times in a row. Without the record each delivery runs: three effects.
//   - concurrent: two workers; each of five operations sent twice back to
//     back (two callers), so both workers get one at the same moment. Without
//     the record both run: two effects.
//   - crash_after_claim, crash_after_effect, crash_before_ack: a worker armed
//     with ONCELER_CRASH_AT dies (SIGKILL, by itself) at that point of the
//     pipeline; once it is dead another worker starts and the producer
//     re-sends the operation with a new task id, as a client does after its
//     call timed out. The redelivered message waits for the lease to lapse,
//     then the task's policy applies. Without the record the worker dies at
//     the same point of its plain run: the redelivered message runs again
//     (after the effect, a second effect) and the re-sent call runs again,
//     so two or three effects. Even where the crash came before any effect,
//     the re-sent call repeats what the redelivery did: the duplicate a
//     client's retry causes every day.
//   - many: sixty distinct operations (Target.Operations) over two workers,
//     every fifth followed by a re-send of an earlier one. With the record
//     each operation has its effect exactly once: none skipped (a record that
//     confused two operations would show a zero), none repeated. Without it
//     the re-sent operations run twice.
//
// # What is asserted
//
// After each scenario the workers are stopped gracefully and the suite
// asserts: every caller got a result (one per delivery in repeated) and it
// is SUCCESS, unless the policy says otherwise; the queue is empty (nothing
// left unacknowledged, nothing lost); the quarantine is empty; no record is
// claimed with a lapsed lease; and the effects per operation (Expect):
//
//	scenario              same-db  lookup  hold        retry        skip
//	repeated, concurrent     1        1      1            1            1
//	crash_after_claim        1        1      0, held      1, takeover  0, skipped
//	crash_after_effect       1        1      1, held      2, takeover  1, skipped
//	crash_before_ack         1        1      1            1            1
//	many                     1        1      1            1            1
//
// Same-database tasks claim, run and complete in one transaction, so a crash
// anywhere leaves either nothing or everything. Outside tasks after a crash
// between claim and completion: lookup asks the outside system by the
// operation's reference (exactly one); hold keeps the record for a person
// (at most one; callers get FAILURE OperationHeld; the suite then resolves
// as a person would with "onceler resolve", completed when the effect
// happened, retry when it did not, and asserts the effect is then exactly
// one and the replayed message's caller answered); retry takes
// the stale claim over and runs again (at most two, the takeover counted in
// "onceler repeats"); skip records it skipped (at most one; callers get
// FAILURE OperationSkipped). Pure tasks have no record and no effects to
// count: only their results are checked.
//
// Env, Worker and the helpers (Send, Replies, QueueDepth, TakeQuarantined,
// StaleClaims, ...) are exported for fault-injection tests of your own.
package replay
