package idempotency_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
)

// TestPurgePrivilegesSufficeForPurge: a role holding exactly
// PurgePrivileges (what the purge command checks at start, and what
// docs/security.md lists for it: USAGE, SELECT and DELETE on records,
// events, attempts) passes the check, so Purge must then work. Purge
// selects the doomed records FOR UPDATE SKIP LOCKED, which PostgreSQL
// allows only with UPDATE on the table as well.
func TestPurgePrivilegesSufficeForPurge(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, idempotency.BatchConfig{Disabled: true})
	p := params("t", "old")
	c := mustClaim(t, e.store, p, idempotency.OutcomeFirst)
	if _, err := e.store.Complete(ctx, p.Ref(c.Token), []byte(`1`)); err != nil {
		t.Fatal(err)
	}
	s, role := roleStore(t, e, idempotency.BatchConfig{Disabled: true})
	if err := e.store.Grant(ctx, role, idempotency.PurgePrivileges()); err != nil {
		t.Fatal(err)
	}
	if err := s.CheckPrivileges(ctx, idempotency.PurgePrivileges()); err != nil {
		t.Fatalf("CheckPrivileges(PurgePrivileges) after granting them: %v", err)
	}
	res, err := s.Purge(ctx, idempotency.PurgeParams{Before: time.Now().Add(time.Hour)})
	if err != nil {
		t.Fatalf("the start check passed, but Purge as a role holding PurgePrivileges fails: %v", err)
	}
	if res.Records != 1 {
		t.Fatalf("purged %d records, want 1", res.Records)
	}
}

// TestCheckPrivilegesAcceptsColumnGrants: a role given the worker's
// privileges on records and attempts as column grants covering every
// column (as a DBA who grants per column does) runs claims, completions,
// failures and attempt counts; the start check must not refuse it.
func TestCheckPrivilegesAcceptsColumnGrants(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, idempotency.BatchConfig{Disabled: true})
	s, role := roleStore(t, e, idempotency.BatchConfig{Disabled: true})
	r := pgx.Identifier{role}.Sanitize()
	var tablePrivs []idempotency.Privilege
	for _, p := range idempotency.WorkerPrivileges() {
		if p.Kind == idempotency.KindTable && (p.Object == "records" || p.Object == "attempts") {
			continue
		}
		tablePrivs = append(tablePrivs, p)
	}
	if err := e.store.Grant(ctx, role, tablePrivs); err != nil {
		t.Fatal(err)
	}
	for _, table := range []string{"records", "attempts"} {
		rows, err := e.pool.Query(ctx, `SELECT column_name::text FROM information_schema.columns WHERE table_schema = $1 AND table_name = $2 ORDER BY ordinal_position`, e.schema, table)
		if err != nil {
			t.Fatal(err)
		}
		cols, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil || len(cols) == 0 {
			t.Fatalf("columns of %s: %v %v", table, cols, err)
		}
		for i, c := range cols {
			cols[i] = pgx.Identifier{c}.Sanitize()
		}
		list := "(" + strings.Join(cols, ", ") + ")"
		testenv.Grant(t, e.pool, "GRANT SELECT "+list+", INSERT "+list+", UPDATE "+list+" ON "+e.schema+"."+table+" TO "+r)
	}
	// The role does the worker's work.
	p := params("t", "k")
	c := mustClaim(t, s, p, idempotency.OutcomeFirst)
	if _, err := s.Complete(ctx, p.Ref(c.Token), []byte(`1`)); err != nil {
		t.Fatalf("Complete with column grants: %v", err)
	}
	mustClaim(t, s, p, idempotency.OutcomeCompleted)
	p = params("t", "f")
	c = mustClaim(t, s, p, idempotency.OutcomeFirst)
	if err := s.Fail(ctx, p.Ref(c.Token), "boom"); err != nil {
		t.Fatalf("Fail with column grants: %v", err)
	}
	if n, err := s.CountAttempt(ctx, "t", "x"); err != nil || n != 1 {
		t.Fatalf("CountAttempt with column grants: %d %v", n, err)
	}
	if err := s.CheckSchema(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.CheckPrivileges(ctx, idempotency.WorkerPrivileges()); err != nil {
		t.Fatalf("the role did the worker's work, yet the start check refuses it: %v", err)
	}
}

// TestCheckPrivilegesAcceptsSequenceUpdate: nextval, which the worker's
// event inserts call on events_id_seq, needs USAGE or UPDATE on the
// sequence. A role that has UPDATE on it instead of USAGE (granted by
// hand, or through the predefined role pg_write_all_data, which gives
// UPDATE on every sequence and no USAGE) writes the repeats log, yet the
// start check demands USAGE and refuses it.
func TestCheckPrivilegesAcceptsSequenceUpdate(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"update on the sequence", "pg_write_all_data"} {
		t.Run(strings.ReplaceAll(how, " ", "_"), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			e := newEnv(t, idempotency.BatchConfig{Disabled: true})
			s, role := roleStore(t, e, idempotency.BatchConfig{Disabled: true})
			r := pgx.Identifier{role}.Sanitize()
			if how == "pg_write_all_data" {
				testenv.Grant(t, e.pool, "GRANT pg_read_all_data, pg_write_all_data TO "+r)
			} else {
				var privs []idempotency.Privilege
				for _, p := range idempotency.WorkerPrivileges() {
					if p.Kind != idempotency.KindSequence {
						privs = append(privs, p)
					}
				}
				if err := e.store.Grant(ctx, role, privs); err != nil {
					t.Fatal(err)
				}
				testenv.Grant(t, e.pool, "GRANT UPDATE ON SEQUENCE "+e.schema+".events_id_seq TO "+r)
			}
			// The role writes events: a duplicate claim and a failure.
			p := params("t", "k")
			c := mustClaim(t, s, p, idempotency.OutcomeFirst)
			if _, err := s.Complete(ctx, p.Ref(c.Token), []byte(`1`)); err != nil {
				t.Fatal(err)
			}
			mustClaim(t, s, p, idempotency.OutcomeCompleted)
			p = params("t", "f")
			c = mustClaim(t, s, p, idempotency.OutcomeFirst)
			if err := s.Fail(ctx, p.Ref(c.Token), "boom"); err != nil {
				t.Fatal(err)
			}
			if n := e.count(t, "SELECT count(*) FROM "+e.schema+".events"); n != 2 {
				t.Fatalf("%d events written, want 2", n)
			}
			if err := s.CheckPrivileges(ctx, idempotency.WorkerPrivileges()); err != nil {
				t.Fatalf("the role wrote the events, yet the start check refuses it: %v", err)
			}
		})
	}
}

// TestMigrateAsOwnerOfExistingSchema: docs/security.md says the role that
// runs migrate "needs CREATE on the database, or to own the schema already
// there". A DBA creates the schema for the owner role (CREATE SCHEMA ...
// AUTHORIZATION owner), without CREATE on the database; Migrate as that
// owner must then create the tables. It fails on its CREATE SCHEMA IF NOT
// EXISTS, which PostgreSQL checks against the database's CREATE privilege
// before it looks whether the schema exists.
func TestMigrateAsOwnerOfExistingSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.Pool(t)
	schema := testenv.Schema(t, pool)
	owner, url := testenv.Role(t, pool)
	testenv.Grant(t, pool, "ALTER SCHEMA "+pgx.Identifier{schema}.Sanitize()+" OWNER TO "+pgx.Identifier{owner}.Sanitize())
	op, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(op.Close)
	s, err := idempotency.New(op, idempotency.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	if err := s.Migrate(ctx); err != nil {
		t.Fatalf("Migrate as the owner of the schema already there: %v", err)
	}
	if err := s.CheckSchema(ctx); err != nil {
		t.Fatal(err)
	}
}
