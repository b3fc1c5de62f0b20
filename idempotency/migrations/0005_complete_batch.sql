-- Completions of a flush in one statement. The join of the arrays with the
-- records is planned here with sequential scans and hash or merge joins
-- off: each element finds its record by primary key, whatever the table's
-- size or statistics were when the plan was cached (a plan made while the
-- table was young would otherwise scan it for every flush). The records are
-- updated in the order the claim statement locks them (ORDER BY 1, 2), so
-- that a flush's completions and another flush's claims of the same keys
-- do not deadlock.
CREATE OR REPLACE FUNCTION __SCHEMA__.complete_batch(
    p_task text[], p_key text[], p_token text[], p_result jsonb[])
RETURNS TABLE (done_task text, done_key text)
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $fn$
BEGIN
    RETURN QUERY
    UPDATE __SCHEMA__.records AS r SET
        status = 'completed', result = v.result, completed_at = now(), updated_at = now(),
        lease_until = NULL, message = NULL
    FROM (SELECT * FROM unnest(p_task, p_key, p_token, p_result) AS u(task, key, token, result)
          ORDER BY 1, 2) AS v
    WHERE r.task = v.task COLLATE "C" AND r.key = v.key COLLATE "C" AND r.token = v.token
      AND r.status IS NOT DISTINCT FROM 'claimed'
    RETURNING r.task::text, r.key::text;
END
$fn$;
