-- Task names and operation keys compare bytewise (collation "C"): the
-- unique key is matched on every claim and completion, and the database's
-- default collation (often a libc locale) makes each comparison a strcoll.
ALTER TABLE __SCHEMA__.records
    ALTER COLUMN task TYPE text COLLATE "C",
    ALTER COLUMN key  TYPE text COLLATE "C";
ALTER TABLE __SCHEMA__.attempts
    ALTER COLUMN task TYPE text COLLATE "C",
    ALTER COLUMN key  TYPE text COLLATE "C";
