-- Redeliveries of same-database operations, counted outside the operation's
-- transaction (which a crash rolls back) so that a message that keeps
-- killing its worker can be stopped. Written only for redelivered messages.
CREATE TABLE IF NOT EXISTS __SCHEMA__.attempts (
    task       text        NOT NULL,
    key        text        NOT NULL,
    attempts   integer     NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task, key)
);
