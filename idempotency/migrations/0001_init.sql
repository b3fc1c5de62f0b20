-- The idempotency record: one row per (task, key).
CREATE TABLE IF NOT EXISTS __SCHEMA__.records (
    task              text        NOT NULL,
    key               text        NOT NULL,
    status            text        NOT NULL
                      CHECK (status IN ('claimed', 'completed', 'failed', 'held', 'skipped')),
    token             text        NOT NULL,
    owner             text        NOT NULL DEFAULT '',
    task_id           text        NOT NULL DEFAULT '',
    attempt           integer     NOT NULL DEFAULT 1,
    fingerprint       bytea,
    claimed_at        timestamptz NOT NULL DEFAULT now(),
    lease_until       timestamptz,
    completed_at      timestamptz,
    updated_at        timestamptz NOT NULL DEFAULT now(),
    result            jsonb,
    error             text        NOT NULL DEFAULT '',
    reason            text        NOT NULL DEFAULT '',
    duplicate_count   integer     NOT NULL DEFAULT 0,
    last_duplicate_at timestamptz,
    last_claim        text        NOT NULL DEFAULT 'first',
    message           bytea,
    PRIMARY KEY (task, key)
);

-- Sweeps of claims whose lease has lapsed.
CREATE INDEX IF NOT EXISTS records_claimed_lease_idx
    ON __SCHEMA__.records (lease_until) WHERE status = 'claimed';
-- Listing by status and retention purge.
CREATE INDEX IF NOT EXISTS records_status_updated_idx
    ON __SCHEMA__.records (status, updated_at);

-- Append-only log of the repeats (duplicates, takeovers, holds, skips,
-- mismatches, failures), written in the same statement as the state change.
CREATE TABLE IF NOT EXISTS __SCHEMA__.events (
    id   bigserial   PRIMARY KEY,
    at   timestamptz NOT NULL DEFAULT now(),
    task text        NOT NULL,
    key  text        NOT NULL,
    kind text        NOT NULL
);
CREATE INDEX IF NOT EXISTS events_at_idx ON __SCHEMA__.events (at, task);
