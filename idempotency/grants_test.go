package idempotency_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
)

// roleStore opens a store on e's schema as a fresh role with no privileges
// on it yet, and returns it with the role's name.
func roleStore(t *testing.T, e *env, batch idempotency.BatchConfig) (*idempotency.Store, string) {
	t.Helper()
	role, url := testenv.Role(t, e.pool)
	return e.overURL(t, url, nil, batch).store, role
}

// TestPrivilegesCoverEverySchemaObject: every table, sequence and function
// the migrations create is named by AdminPrivileges and WorkerPrivileges,
// so that a migration that adds one cannot leave the grants behind.
func TestPrivilegesCoverEverySchemaObject(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{Disabled: true})
	rows, err := e.pool.Query(context.Background(), `
SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = $1 AND c.relkind IN ('r', 'S', 'p')
UNION ALL
SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = $1`, e.schema)
	if err != nil {
		t.Fatal(err)
	}
	objects, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	// The worker uses every object of the schema (events and its sequence
	// for the repeats log, migrations for the version check), so
	// WorkerPrivileges, too, must name each one.
	for what, privs := range map[string][]idempotency.Privilege{
		"AdminPrivileges": idempotency.AdminPrivileges(), "WorkerPrivileges": idempotency.WorkerPrivileges(),
	} {
		named := map[string]bool{}
		for _, p := range privs {
			named[strings.SplitN(p.Object, "(", 2)[0]] = true
		}
		for _, o := range objects {
			if !named[o] {
				t.Errorf("%s.%s is in no privilege of %s", e.schema, o, what)
			}
		}
	}
	if len(objects) < 5 {
		t.Fatalf("found only %v", objects)
	}
}

// TestWorkerPrivilegesRunTheRecord: a role given WorkerPrivileges (and
// nothing else) claims, completes (alone and in batches), fails, takes
// over, holds, counts attempts, records follow-ups, runs same-database
// operations and checks the schema; it cannot read the repeats log nor
// purge, which AdminPrivileges add.
func TestWorkerPrivilegesRunTheRecord(t *testing.T) {
	t.Parallel()
	for _, disabled := range []bool{false, true} {
		t.Run(map[bool]string{false: "batched", true: "unbatched"}[disabled], func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			e := newEnv(t, idempotency.BatchConfig{Disabled: true})
			// As a careful DBA does: functions are not everyone's.
			if _, err := e.pool.Exec(ctx, "REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA "+e.schema+" FROM PUBLIC"); err != nil {
				t.Fatal(err)
			}
			s, role := roleStore(t, e, idempotency.BatchConfig{Disabled: disabled, GroupTx: 4})
			var pe *idempotency.PrivilegeError
			if err := s.CheckPrivileges(ctx, idempotency.WorkerPrivileges()); !errors.As(err, &pe) || pe.Role != role {
				t.Fatalf("CheckPrivileges before the grant: %v", err)
			}
			if err := e.store.Grant(ctx, role, idempotency.WorkerPrivileges()); err != nil {
				t.Fatal(err)
			}
			if err := e.store.Grant(ctx, role, idempotency.WorkerPrivileges()); err != nil {
				t.Fatalf("granting again: %v", err)
			}
			if err := s.CheckPrivileges(ctx, idempotency.WorkerPrivileges()); err != nil {
				t.Fatal(err)
			}
			for _, ps := range [][]idempotency.Privilege{idempotency.ListPrivileges(), idempotency.ResolvePrivileges()} {
				if err := s.CheckPrivileges(ctx, ps); err != nil {
					t.Fatal(err)
				}
			}
			if err := s.CheckSchema(ctx); err != nil {
				t.Fatal(err)
			}

			// Concurrent claims and completions: batched, they go through
			// the batch statements and complete_batch.
			var wg sync.WaitGroup
			errs := make(chan error, 16)
			for i := range 16 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					p := params("t", "k"+string(rune('a'+i)))
					c, err := s.Claim(ctx, p)
					if err == nil {
						_, err = s.Complete(ctx, p.Ref(c.Token), []byte(`1`))
					}
					if err == nil {
						// A duplicate writes an event.
						_, err = s.Claim(ctx, p)
					}
					errs <- err
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				if err != nil {
					t.Fatal(err)
				}
			}
			p := params("t", "fail")
			c := mustClaim(t, s, p, idempotency.OutcomeFirst)
			if err := s.Fail(ctx, p.Ref(c.Token), "boom"); err != nil {
				t.Fatal(err)
			}
			p = params("t", "stale")
			mustClaim(t, s, p, idempotency.OutcomeFirst)
			e.expire(t, "t", "stale")
			p.Token = idempotency.NewToken()
			stale := mustClaim(t, s, p, idempotency.OutcomeStale)
			if c, err := s.ApplyPolicy(ctx, p, stale, idempotency.StalePolicy{Policy: idempotency.PolicyHold}); err != nil || c.Outcome != idempotency.OutcomeHeld {
				t.Fatalf("hold: %+v %v", c, err)
			}
			if err := s.ResolveCompleted(ctx, "t", "stale", []byte(`2`)); err != nil {
				t.Fatal(err)
			}
			if n, err := s.CountAttempt(ctx, "t", "x"); err != nil || n != 1 {
				t.Fatalf("CountAttempt: %d %v", n, err)
			}
			if n, err := s.CountAttempt(ctx, "t", "x"); err != nil || n != 2 {
				t.Fatalf("CountAttempt again: %d %v", n, err)
			}
			if err := s.AddFollowups(ctx, "t", "ka", []string{"f"}); err != nil {
				t.Fatal(err)
			}
			if ids, err := s.Followups(ctx, "t", "ka"); err != nil || !slices.Equal(ids, []string{"f"}) {
				t.Fatalf("Followups: %v %v", ids, err)
			}
			if c, err := s.RunTx(ctx, params("t", "tx"), func(context.Context, pgx.Tx) ([]byte, error) { return []byte(`3`), nil }); err != nil || c.Outcome != idempotency.OutcomeFirst {
				t.Fatalf("RunTx: %+v %v", c, err)
			}
			if recs, err := s.List(ctx, idempotency.Filter{Limit: 100}); err != nil || len(recs) != 19 {
				t.Fatalf("List: %d records, %v", len(recs), err)
			}
			if _, err := s.StaleClaims(ctx); err != nil {
				t.Fatal(err)
			}

			// Not the worker's: the repeats log and the purge.
			if _, err := s.Repeats(ctx, time.Now().Add(-time.Hour)); err == nil {
				t.Fatal("Repeats worked without SELECT on events")
			}
			if err := s.CheckPrivileges(ctx, idempotency.PurgePrivileges()); !errors.As(err, &pe) || len(pe.Missing) != 4 {
				t.Fatalf("purge privileges of the worker role: %v", err)
			}
			if err := e.store.Grant(ctx, role, idempotency.AdminPrivileges()); err != nil {
				t.Fatal(err)
			}
			if err := s.CheckPrivileges(ctx, idempotency.AdminPrivileges()); err != nil {
				t.Fatal(err)
			}
			if st, err := s.Repeats(ctx, time.Now().Add(-time.Hour)); err != nil || len(st) != 1 || st[0].Duplicates != 16 {
				t.Fatalf("Repeats: %+v %v", st, err)
			}
			if _, err := s.Purge(ctx, idempotency.PurgeParams{Before: time.Now().Add(time.Hour)}); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestCheckPrivilegesNamesWhatIsMissing: the error names each missing
// privilege, schema and object quoted; a missing schema is not its
// business (CheckSchema reports it).
func TestCheckPrivilegesNamesWhatIsMissing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, idempotency.BatchConfig{Disabled: true})
	s, role := roleStore(t, e, idempotency.BatchConfig{Disabled: true})
	if err := e.store.Grant(ctx, role, idempotency.WorkerPrivileges()); err != nil {
		t.Fatal(err)
	}
	id := pgx.Identifier{role}.Sanitize()
	if _, err := e.pool.Exec(ctx, "REVOKE UPDATE ON "+e.schema+".records FROM "+id); err != nil {
		t.Fatal(err)
	}
	var pe *idempotency.PrivilegeError
	err := s.CheckPrivileges(ctx, idempotency.WorkerPrivileges())
	if !errors.As(err, &pe) || len(pe.Missing) != 1 {
		t.Fatalf("after revoking UPDATE: %v", err)
	}
	want := `UPDATE on TABLE "` + e.schema + `".records`
	if pe.Lacks() != want || pe.Role != role || !strings.Contains(err.Error(), want) {
		t.Fatalf("Lacks() = %q (role %q), want %q", pe.Lacks(), pe.Role, want)
	}
	if _, err := e.pool.Exec(ctx, "REVOKE USAGE ON SCHEMA "+e.schema+" FROM "+id); err != nil {
		t.Fatal(err)
	}
	err = s.CheckPrivileges(ctx, idempotency.WorkerPrivileges())
	if !errors.As(err, &pe) || pe.Lacks() != `USAGE on SCHEMA "`+e.schema+`", `+want {
		t.Fatalf("after revoking USAGE: %v", err)
	}
	other, err := idempotency.New(e.pool, idempotency.Config{Schema: e.schema + "_none"})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if err := other.CheckPrivileges(ctx, idempotency.WorkerPrivileges()); err != nil {
		t.Fatalf("missing schema: %v", err)
	}
}

// TestGrantStatements: one statement per object, privileges merged.
func TestGrantStatements(t *testing.T) {
	t.Parallel()
	got := idempotency.GrantStatements("onceler", "w", idempotency.AdminPrivileges())
	want := []string{
		`GRANT USAGE ON SCHEMA "onceler" TO "w"`,
		`GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE "onceler".records TO "w"`,
		`GRANT SELECT, INSERT, DELETE ON TABLE "onceler".events TO "w"`,
		`GRANT USAGE ON SEQUENCE "onceler".events_id_seq TO "w"`,
		`GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE "onceler".attempts TO "w"`,
		`GRANT SELECT ON TABLE "onceler".migrations TO "w"`,
		`GRANT EXECUTE ON FUNCTION "onceler".complete_batch(text[], text[], text[], jsonb[]) TO "w"`,
	}
	if !slices.Equal(got, want) {
		t.Fatalf("GrantStatements:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}
