package idempotency

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migration is one versioned schema change, embedded in the binary.
type Migration struct {
	Version int
	Name    string
	SQL     string // with the placeholder __SCHEMA__ for the schema
}

// Migrations returns the embedded migrations in version order.
func Migrations() ([]Migration, error) {
	entries, err := fs.ReadDir(migrationFiles, "migrations")
	if err != nil {
		return nil, fmt.Errorf("read migrations: %w", err)
	}
	var ms []Migration
	for _, e := range entries {
		name := e.Name()
		num, rest, ok := strings.Cut(name, "_")
		if !ok || !strings.HasSuffix(rest, ".sql") {
			return nil, fmt.Errorf("migration %q: name must be NNNN_name.sql", name)
		}
		v, err := strconv.Atoi(num)
		if err != nil {
			return nil, fmt.Errorf("migration %q: version: %w", name, err)
		}
		b, err := migrationFiles.ReadFile("migrations/" + name)
		if err != nil {
			return nil, fmt.Errorf("read migration %q: %w", name, err)
		}
		ms = append(ms, Migration{Version: v, Name: strings.TrimSuffix(rest, ".sql"), SQL: string(b)})
	}
	sort.Slice(ms, func(i, j int) bool { return ms[i].Version < ms[j].Version })
	return ms, nil
}

// migrateLockSQL takes the transaction-scoped advisory lock of the schema
// ($1) that serializes Migrate and Grant.
const migrateLockSQL = `SELECT pg_advisory_xact_lock(hashtextextended('onceler.idempotency.migrate:' || $1, 0))`

// Migrate creates the schema and applies the migrations not yet applied, in
// one transaction. It is idempotent and safe to run from several processes
// at once: a transaction-scoped advisory lock per schema serializes them.
func (s *Store) Migrate(ctx context.Context) error {
	ms, err := Migrations()
	if err != nil {
		return err
	}
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("migrate: begin: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()

	if _, err := tx.Exec(ctx, migrateLockSQL, s.name); err != nil {
		return fmt.Errorf("migrate: lock: %w", err)
	}
	// CREATE SCHEMA IF NOT EXISTS needs CREATE on the database even when the
	// schema exists: the owner of a schema a DBA made need not have it.
	var exists bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1)`, s.name).Scan(&exists); err != nil {
		return fmt.Errorf("migrate: look for the schema: %w", err)
	}
	if !exists {
		if _, err := tx.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS `+s.schema); err != nil {
			return fmt.Errorf("migrate: create schema: %w", err)
		}
	}
	if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+s.schema+`.migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		return fmt.Errorf("migrate: create migrations table: %w", err)
	}
	applied := map[int]bool{}
	rows, err := tx.Query(ctx, `SELECT version FROM `+s.schema+`.migrations`)
	if err != nil {
		return fmt.Errorf("migrate: read applied: %w", err)
	}
	versions, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return fmt.Errorf("migrate: read applied: %w", err)
	}
	for _, v := range versions {
		applied[int(v)] = true
	}
	n := 0
	for _, m := range ms {
		if applied[m.Version] {
			continue
		}
		if _, err := tx.Exec(ctx, strings.ReplaceAll(m.SQL, "__SCHEMA__", s.schema)); err != nil {
			return fmt.Errorf("migrate: apply %04d_%s: %w", m.Version, m.Name, err)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO `+s.schema+`.migrations (version, name) VALUES ($1, $2)`, m.Version, m.Name); err != nil {
			return fmt.Errorf("migrate: record %04d_%s: %w", m.Version, m.Name, err)
		}
		n++
	}
	if err := tx.Commit(ctx); err != nil {
		return writeError("migrate: commit", err)
	}
	if n > 0 {
		s.log.Info("idempotency schema migrated", zap.Int("applied", n))
	}
	return nil
}

// ErrSchemaNotCurrent reports a record schema that is missing or lacks
// migrations this binary needs (see SchemaError).
var ErrSchemaNotCurrent = errors.New("idempotency: record schema not current")

// SchemaError reports a record schema that does not exist or is older than
// the binary: the store cannot serve until Migrate runs.
type SchemaError struct {
	Schema string // the schema's name
	Have   int    // the highest version applied; 0 when the schema is missing
	Want   int    // the highest version this binary knows
}

func (e *SchemaError) Error() string {
	if e.Have == 0 {
		return fmt.Sprintf("idempotency: record schema %q does not exist (this binary needs version %d)", e.Schema, e.Want)
	}
	return fmt.Sprintf("idempotency: record schema %q is at version %d, older than this binary's %d", e.Schema, e.Have, e.Want)
}

// Unwrap lets errors.Is match ErrSchemaNotCurrent.
func (e *SchemaError) Unwrap() error { return ErrSchemaNotCurrent }

// CheckSchema returns a *SchemaError when the schema is missing or lacks a
// migration this binary embeds, nil when every one is applied (a newer
// schema, migrated by a newer binary, is accepted), or the error that kept
// it from looking.
func (s *Store) CheckSchema(ctx context.Context) error {
	ms, err := Migrations()
	if err != nil {
		return err
	}
	want := 0
	if len(ms) > 0 {
		want = ms[len(ms)-1].Version
	}
	var table *string
	if err := s.pool.QueryRow(ctx, `SELECT to_regclass($1)::text`, s.schema+".migrations").Scan(&table); err != nil {
		return fmt.Errorf("check record schema %q: %w", s.name, err)
	}
	if table == nil {
		return &SchemaError{Schema: s.name, Want: want}
	}
	rows, err := s.pool.Query(ctx, `SELECT version FROM `+s.schema+`.migrations`)
	if err != nil {
		return fmt.Errorf("check record schema %q: %w", s.name, err)
	}
	versions, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return fmt.Errorf("check record schema %q: %w", s.name, err)
	}
	applied, have := map[int]bool{}, 0
	for _, v := range versions {
		applied[int(v)] = true
		have = max(have, int(v))
	}
	for _, m := range ms {
		if !applied[m.Version] {
			return &SchemaError{Schema: s.name, Have: have, Want: want}
		}
	}
	return nil
}
