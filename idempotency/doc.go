// Package idempotency keeps the durable record that makes a task's effect
// happen once: a row per (task name, operation key) in PostgreSQL, claimed
// atomically, fenced by a claim token, and completed only when the work is
// done.
//
// The package knows nothing of AMQP or Celery. Its API takes plain values
// (task name, operation key, argument fingerprint, message bytes), so any
// consumer can use it.
//
// # Schema
//
// Store.Migrate creates the schema (Config.Schema, default "onceler") and
// applies the embedded, versioned migrations (see Migrations) in one
// transaction under an advisory lock: it is idempotent and safe to run from
// several processes at once. The records table has one row per (task, key);
// the events table is an append-only log of repeats (duplicates, takeovers,
// holds, skips, mismatches, failures) written in the same statement as the
// state change, which makes Store.Repeats exact.
//
// # States
//
//	           Claim (no record, or failed)
//	                        │
//	                        ▼
//	┌── TakeOver ──────► claimed ── Complete ──────────► completed (final)
//	│ (lease lapsed:      │ │ │
//	│  new token,         │ │ └──── Fail, Release ─────► failed ── Claim ──► claimed
//	│  attempt + 1)       │ └────── Skip (lapsed) ─────► skipped
//	└─────────────────────┤
//	                      └──────── Hold (lapsed) ─────► held
//	                                                       ├─ ResolveCompleted ──► completed
//	                                                       └─ ResolveRetry ──────► failed
//
// The states:
//
//   - claimed: a delivery holds the claim: a token and a lease (lease_until).
//     Complete, Fail, Release, Renew, Skip and Hold require the token, so an
//     owner whose claim was taken over is fenced out (ErrFenced). A lapsed
//     lease cannot be renewed. Lapse ends the lease at once, for an owner
//     that stops without knowing whether its effect happened: the next
//     Claim finds the claim stale.
//   - completed: the effect happened; final. A later Claim gets
//     OutcomeCompleted and the stored result, and is counted as a duplicate.
//   - failed: the run failed (the error is kept) or was released; a later
//     Claim claims it again (OutcomeFirst, attempt+1).
//   - held: a stale claim waits for a person: ResolveCompleted marks it
//     completed, ResolveRetry makes it failed (claimable) and returns the
//     kept message for republishing.
//   - skipped: a stale claim was abandoned by policy (the rare miss).
//
// Skip and Hold settle only a claim whose lease has lapsed (a stale view
// cannot settle a claim its owner has claimed again), and they change the
// record's token, so the old owner's late Complete or Fail is fenced, also
// after a person resolved the record.
//
// Purge deletes old completed, failed and skipped records in bounded
// batches; it never touches claimed or held ones. PurgeParams.DryRun counts
// what it would delete, per task and status, and deletes nothing.
//
// # Claim
//
// Store.Claim is one statement (INSERT ... ON CONFLICT DO UPDATE ...
// RETURNING) that says what the delivery found: OutcomeFirst (claimed now,
// with a fresh token), OutcomeCompleted, OutcomeInProgress (another live
// claim; counted as a duplicate), OutcomeStale (the claimant's lease lapsed),
// OutcomeMismatch (same key, different argument fingerprint: the default is
// to refuse; ClaimParams.AllowMismatch claims anyway), OutcomeHeld or
// OutcomeSkipped. Of any number of concurrent claims of one key, exactly
// one is first.
//
// # Outside-system mode and stale-claim policies
//
// For an effect in another system, the claim commits first, the task runs
// with the operation key as the outside system's reference, and Complete
// records the result. While it runs, Store.Keep renews the lease every
// lease/3; if it cannot renew before the lease lapses, the task's context
// is cancelled with cause ErrLeaseLost and the task must not complete.
//
// A claim found stale (its worker crashed or stalled) is settled by the
// task's policy through Store.ApplyPolicy:
//
//   - PolicyLookup: take over, then ask the outside system (a LookupFunc)
//     whether the operation happened: found → completed with its result; not
//     found → run again; error → the fallback policy.
//   - PolicyRetry: take over and run again (the rare duplicate, counted as a
//     takeover).
//   - PolicySkip: record skipped and do not run (the rare miss, counted).
//   - PolicyHold: record held with the message to replay, for a person.
//
// Takeover is atomic: of several deliveries taking over one stale claim,
// exactly one wins, with a new token and the attempt bumped.
//
// # Same-database mode
//
// Store.RunTx claims, runs the task's effect through the pgx.Tx it hands
// over, and completes, all in one transaction: a concurrent duplicate
// blocks on the unique key and then sees the record completed; an error
// rolls everything back (no record, no effect); no lease is needed.
//
// # Batching
//
// Claims and completions of concurrent deliveries are group-committed: a
// caller that finds no flush running flushes at once (so an idle store
// costs one round trip), and calls arriving meanwhile queue and go out
// together as one claim statement over unnest() arrays and one completion
// statement (a function whose join finds each record by primary key, however
// the table has grown since its plan was cached), pipelined with a single
// Sync, so one commit. With BatchConfig.Flushers above 1 (default 1), a
// second flush starts once as many calls are queued as the last flush
// carried, so that one flush's commit overlaps the next one's statements.
// Each caller still gets its own exact outcome; repeats of a key within a
// flush wait for the next flush.
// BatchConfig.Disabled turns it off.
//
// Every statement that changes a claim finds its record by the primary key
// alone: the status test is written so that no index on status can serve
// it (see currentClaim in sql.go), since those indexes hold every claim in
// flight and the dead versions of finished ones. Task names and keys
// compare bytewise (collation "C").
//
// # Errors
//
// ErrFenced, ErrNotFound, ErrNotHeld and ErrLeaseLost are sentinels for
// errors.Is. IsRetryable reports transient failures (connection loss,
// serialization failure, deadlock). A write whose commit may or may not have
// happened (the connection was lost after the request was sent, or the
// caller gave up while it was in flight) is ErrUnknownOutcome
// (IsUnknownOutcome): the caller must not ack the message; Complete with the
// same token is safe to repeat, and so is a claim made with a token of the
// caller's (ClaimParams.Token): a claim or takeover that committed while
// its answer was lost is then found to be the caller's own (OutcomeFirst,
// the same attempt), not another's claim in progress that would lapse into
// the stale-claim policy. RunTx's claims are not: its claim commits with the
// effect and the completion, so a claimed record is never its own.
package idempotency
