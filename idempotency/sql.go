package idempotency

import "strings"

// queries holds every statement of the package, with the schema filled in.
type queries struct {
	claimOne, claimBatch string
	// claimOneTx and claimBatchTx claim for RunTx (ownClaim false): see
	// inTxClaim.
	claimOneTx, claimBatchTx string
	complete                 string
	completeBatch            string
	renew                    string
	lapse                    string
	fail, release            string
	skip, hold               string
	state                    string
	ownClaims                string
	rewrite, reclaim         string
	get, list                string
	staleClaims              string
	probe                    string
	resolveCompleted         string
	resolveRetry             string
	repeats                  string
	purgeRecords             string
	purgeEvents              string
	countPurgeRecords        string
	countPurgeEvents         string
}

// purgeableRecords selects the records a purge may delete: final ones (never
// claimed or held) last changed before $1.
const purgeableRecords = `status IN ('completed', 'failed', 'skipped') AND updated_at < $1`

// claimSQL is the claim: one statement that inserts a fresh claim, or on
// conflict decides from the current row (which ON CONFLICT DO UPDATE always
// reads in its latest committed version, after waiting for a concurrent
// writer) what this delivery found, claims it again when it may (failed, or
// lapsed and {TAKEOVER}), counts duplicates, and logs repeats in the events
// table. The decision is written to last_claim and returned.
const claimSQL = `
WITH up AS (
    INSERT INTO {S}.records AS r
        (task, key, status, token, owner, task_id, attempt, fingerprint,
         claimed_at, lease_until, message, last_claim)
    SELECT v.task, v.key, 'claimed', v.token, v.owner, v.task_id, 1, NULLIF(v.fp, ''::bytea),
           now(), now() + v.lease_us * interval '1 microsecond', v.message, 'first'
    FROM {SRC}
    ORDER BY 1, 2
    ON CONFLICT (task, key) DO UPDATE SET
        status            = CASE WHEN {CLAIM} THEN 'claimed' ELSE r.status END,
        token             = CASE WHEN {CLAIM} THEN EXCLUDED.token ELSE r.token END,
        owner             = CASE WHEN {CLAIM} THEN EXCLUDED.owner ELSE r.owner END,
        task_id           = CASE WHEN {CLAIM} THEN EXCLUDED.task_id ELSE r.task_id END,
        attempt           = CASE WHEN {CLAIM} AND NOT {OWN} THEN r.attempt + 1 ELSE r.attempt END,
        fingerprint       = CASE WHEN {CLAIM} THEN COALESCE(EXCLUDED.fingerprint, r.fingerprint) ELSE r.fingerprint END,
        claimed_at        = CASE WHEN {CLAIM} THEN now() ELSE r.claimed_at END,
        lease_until       = CASE WHEN {CLAIM} THEN EXCLUDED.lease_until ELSE r.lease_until END,
        message           = CASE WHEN {CLAIM} THEN COALESCE(EXCLUDED.message, r.message) ELSE r.message END,
        updated_at        = CASE WHEN {CLAIM} THEN now() ELSE r.updated_at END,
        duplicate_count   = r.duplicate_count + CASE WHEN {DUP} THEN 1 ELSE 0 END,
        last_duplicate_at = CASE WHEN {DUP} THEN now() ELSE r.last_duplicate_at END,
        last_claim        = {NOTE}
    RETURNING r.task, r.key, r.status, r.token, r.attempt, r.result, r.error,
              r.lease_until, r.owner, r.task_id, r.last_claim
), ev AS (
    INSERT INTO {S}.events (task, key, kind)
    SELECT task, key, CASE WHEN last_claim IN ('completed', 'in_progress') THEN 'duplicate' ELSE last_claim END
    FROM up WHERE last_claim IN ('completed', 'in_progress', 'takeover', 'mismatch')
)
SELECT task, key, status, token, attempt, result, error, lease_until, owner, task_id, last_claim FROM up`

// ownClaim is true when the existing row r is claimed with the token this
// claim brings: a claim whose answer was lost committed, and its caller
// claims again with the same token (ClaimParams.Token). It is the caller's
// own claim, whatever its lease: first again, the attempt not counted twice.
const ownClaim = `(r.status = 'claimed' AND r.token = EXCLUDED.token)`

// inTxClaim is ownClaim for RunTx's claims, which commit with their
// effects and completions: a claimed record that committed on its own was
// committed by a task that ended its transaction itself, its effect maybe
// with it, whatever the token. It is never found to be the caller's own:
// in progress, then stale.
const inTxClaim = `false`

// claimNote is what a delivery found on an existing row r.
const claimNote = `(CASE
            WHEN r.fingerprint <> EXCLUDED.fingerprint AND NOT {ALLOW} THEN 'mismatch'
            WHEN {OWN} THEN 'first'
            WHEN r.status = 'failed' THEN 'first'
            WHEN r.status = 'completed' THEN 'completed'
            WHEN r.status = 'claimed' AND r.lease_until > now() THEN 'in_progress'
            WHEN r.status = 'claimed' AND {TAKEOVER} THEN 'takeover'
            WHEN r.status = 'claimed' THEN 'stale'
            ELSE r.status
        END)`

const claimOneSource = `(VALUES ($1::text, $2::text, $3::text, $4::text, $5::text, $6::bytea, $7::bigint, $8::bytea))
         AS v(task, key, token, owner, task_id, fp, lease_us, message)`

const claimBatchSource = `unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::bytea[], $7::bigint[], $8::bytea[])
         AS v(task, key, token, owner, task_id, fp, lease_us, message)`

// currentClaim matches the record ($1 task, $2 key) while $3 is its current
// claim. The status test is written so that it cannot use the indexes on
// status (the partial index of claimed leases, the status index): they hold
// every in-flight claim and, until a vacuum, the dead versions of finished
// ones, and a plan that scans them instead of looking the record up by its
// key grows slower with every claim in flight. This way the only index that
// serves the statement is the primary key, whatever the statistics.
const currentClaim = `task = $1 AND key = $2 AND token = $3 AND status IS NOT DISTINCT FROM 'claimed'`

// completeSQL completes the record ($1 task, $2 key) while $3 is its current
// claim, storing result $4, and returns a row if it did: a lone completion.
// A flush of several completes them in one statement, the function
// complete_batch (migration 0005): a plain statement joining arrays of keys
// with the records is planned from the table's size and statistics when
// its plan is cached, and a plan made while the table was young scans it
// on every flush; the function plans its join with scans and hash or merge
// joins off, so each element finds its record by primary key
// (TestBatchedCompletionsNeverScan), and (migration 0006) always runs that
// generic plan: left to choose, PL/pgSQL planned it again for every flush.
const completeSQL = `
UPDATE {S}.records SET
    status = 'completed', result = $4::jsonb, completed_at = now(), updated_at = now(),
    lease_until = NULL, message = NULL
WHERE ` + currentClaim + `
RETURNING true`

func newQueries(schema string) queries {
	fill := func(q string) string { return strings.ReplaceAll(q, "{S}", schema) }
	claim := func(src, takeover, allow, own string) string {
		note := strings.NewReplacer("{ALLOW}", allow, "{TAKEOVER}", takeover, "{OWN}", own).Replace(claimNote)
		return fill(strings.NewReplacer(
			"{SRC}", src,
			"{CLAIM}", note+" IN ('first', 'takeover')",
			"{DUP}", note+" IN ('completed', 'in_progress')",
			"{NOTE}", note,
			"{OWN}", own,
		).Replace(claimSQL))
	}
	const cols = `task, key, status, token, owner, task_id, attempt, fingerprint, claimed_at,
        lease_until, completed_at, updated_at, result, error, reason, duplicate_count,
        last_duplicate_at, message, COALESCE(status = 'claimed' AND lease_until > now(), false)`
	// endClaim ends the current claim ($1 task, $2 key, $3 token) with the
	// assignments of set (where: more conditions), logs an event of kind,
	// and counts the rows it changed (0: the claim is no longer current).
	endClaim := func(set, kind string, where ...string) string {
		return fill(`WITH up AS (
    UPDATE {S}.records SET ` + set + `, lease_until = NULL, updated_at = now()
    WHERE ` + currentClaim + strings.Join(where, "") + `
    RETURNING task, key
), ev AS (INSERT INTO {S}.events (task, key, kind) SELECT task, key, '` + kind + `' FROM up)
SELECT count(*) FROM up`)
	}
	return queries{
		claimOne:     claim(claimOneSource, "$9::bool", "$10::bool", ownClaim),
		claimBatch:   claim(claimBatchSource, "false", "false", ownClaim),
		claimOneTx:   claim(claimOneSource, "$9::bool", "$10::bool", inTxClaim),
		claimBatchTx: claim(claimBatchSource, "false", "false", inTxClaim),
		complete:     fill(completeSQL),
		completeBatch: fill(`SELECT done_task, done_key
FROM {S}.complete_batch($1::text[], $2::text[], $3::text[], $4::jsonb[])`),
		renew: fill(`UPDATE {S}.records SET lease_until = now() + $4::bigint * interval '1 microsecond'
WHERE ` + currentClaim + ` AND lease_until > now()`),
		lapse: fill(`UPDATE {S}.records SET lease_until = now(), updated_at = now()
WHERE ` + currentClaim),
		fail: endClaim(`status = 'failed', error = $4`, "failure"),
		release: fill(`UPDATE {S}.records SET status = 'failed', error = '', reason = 'released',
    lease_until = NULL, updated_at = now()
WHERE ` + currentClaim),
		// Skip and hold settle a claim another delivery left stale ($5, $6
		// true: only once its lease has lapsed, so a stale view cannot settle
		// a claim its owner has since claimed again), or the caller's own
		// fresh takeover (false). The token changes with the settlement, so
		// that the old owner's late Complete or Fail is told it is fenced,
		// also after a person resolves the record.
		skip: endClaim(`status = 'skipped', reason = $4, token = 'settled:' || token`, "skipped",
			` AND (NOT $5::bool OR lease_until <= now())`),
		hold: endClaim(`status = 'held', reason = $5, message = COALESCE($4, message), token = 'settled:' || token`, "held",
			` AND (NOT $6::bool OR lease_until <= now())`),
		state: fill(`SELECT status, token FROM {S}.records WHERE task = $1 AND key = $2`),
		// The claims of arrays ($1 tasks, $2 keys, $3 tokens) that are
		// current, each looked up by its key (the LIMIT keeps the lookup
		// per element, whatever the statistics).
		ownClaims: fill(`SELECT v.task, v.key FROM unnest($1::text[], $2::text[], $3::text[]) AS v(task, key, token)
CROSS JOIN LATERAL (SELECT 1 FROM {S}.records r
    WHERE r.task = v.task AND r.key = v.key AND r.token = v.token AND r.status IS NOT DISTINCT FROM 'claimed' LIMIT 1) AS cur`),
		// Writes the final state of a claim the record has lost (no row):
		// inserted as it would have been updated, and nothing when a row
		// exists (another delivery claimed the operation in between).
		rewrite: fill(`WITH up AS (
    INSERT INTO {S}.records AS r (task, key, status, token, result, error, reason, message,
        completed_at, lease_until, last_claim)
    VALUES ($1, $2, $3, $4, $5::jsonb, $6, $7, $8,
        CASE WHEN $3 = 'completed' THEN now() END, NULL, 'first')
    ON CONFLICT (task, key) DO NOTHING
    RETURNING task, key
), ev AS (INSERT INTO {S}.events (task, key, kind) SELECT task, key, $9 FROM up WHERE $9 <> '')
SELECT count(*) FROM up`),
		// Writes a claim the record has lost anew, with its token and lease.
		reclaim: fill(`INSERT INTO {S}.records AS r (task, key, status, token, claimed_at, lease_until, last_claim)
VALUES ($1, $2, 'claimed', $3, now(), now() + $4::bigint * interval '1 microsecond', 'first')
ON CONFLICT (task, key) DO NOTHING`),
		get: fill(`SELECT ` + cols + ` FROM {S}.records WHERE task = $1 AND key = $2`),
		list: fill(`SELECT ` + cols + ` FROM {S}.records
WHERE ($1 = '' OR task = $1) AND ($2 = '' OR key = $2) AND ($3 = '' OR status = $3)
  AND (NOT $7::bool OR (status = 'claimed' AND lease_until <= now()))
  AND (task, key) > ($4, $5)
ORDER BY task, key LIMIT $6`),
		// Waits for the row lock of an uncommitted claim of the record, or
		// of a writer of its committed row (see Running).
		probe: fill(`INSERT INTO {S}.records AS r (task, key, status, token) VALUES ($1, $2, 'failed', '')
ON CONFLICT (task, key) DO UPDATE SET updated_at = r.updated_at`),
		// Served by the partial index of claimed leases.
		staleClaims: fill(`SELECT count(*) FROM {S}.records WHERE status = 'claimed' AND lease_until <= now()`),
		resolveCompleted: fill(`UPDATE {S}.records SET status = 'completed', result = $3::jsonb,
    completed_at = now(), updated_at = now(), reason = 'resolved completed', message = NULL
WHERE task = $1 AND key = $2 AND status = 'held'`),
		resolveRetry: fill(`UPDATE {S}.records SET status = 'failed', reason = 'resolved retry', updated_at = now()
WHERE task = $1 AND key = $2 AND status = 'held'
RETURNING message`),
		repeats: fill(`SELECT task,
    count(*) FILTER (WHERE kind = 'duplicate'),
    count(*) FILTER (WHERE kind = 'takeover'),
    count(*) FILTER (WHERE kind = 'held'),
    count(*) FILTER (WHERE kind = 'skipped'),
    count(*) FILTER (WHERE kind = 'mismatch'),
    count(*) FILTER (WHERE kind = 'failure')
FROM {S}.events WHERE at >= $1 AND at <= now()
GROUP BY task ORDER BY task`),
		// The purge statements and their dry-run counts select the same
		// rows in the same order: a purge of k batches of n deletes the
		// first k×n (LIMIT NULL: all).
		purgeRecords: fill(`WITH doomed AS (
    SELECT task, key FROM {S}.records
    WHERE ` + purgeableRecords + `
    ORDER BY status, updated_at LIMIT $2
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM {S}.records AS r USING doomed d
    WHERE r.task = d.task AND r.key = d.key AND r.status IN ('completed', 'failed', 'skipped')
    RETURNING r.task, r.status
)
SELECT task, status, count(*) FROM gone GROUP BY task, status`),
		purgeEvents: fill(`DELETE FROM {S}.events WHERE id IN (
    SELECT id FROM {S}.events WHERE at < $1 ORDER BY at LIMIT $2)`),
		countPurgeRecords: fill(`SELECT task, status, count(*) FROM (
    SELECT task, status FROM {S}.records
    WHERE ` + purgeableRecords + `
    ORDER BY status, updated_at LIMIT $2
) d GROUP BY task, status`),
		countPurgeEvents: fill(`SELECT count(*) FROM (
    SELECT 1 FROM {S}.events WHERE at < $1 ORDER BY at LIMIT $2) e`),
	}
}
