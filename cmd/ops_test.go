package cmd

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
)

// recordEnv is a migrated record in a schema of its own, and the
// environment that points the commands at it.
type recordEnv struct {
	pool   *pgxpool.Pool
	store  *idempotency.Store
	schema string
	env    map[string]string
}

func newRecordEnv(t *testing.T) *recordEnv {
	t.Helper()
	pool := testenv.Pool(t)
	schema := testenv.Schema(t, pool)
	env := map[string]string{"ONCELER_DATABASE_URL": testenv.DatabaseURL(t), "ONCELER_SCHEMA": schema}
	if r := runIn(t, env, "migrate"); r.err != nil {
		t.Fatalf("migrate: %v", r.err)
	}
	store, err := idempotency.New(pool, idempotency.Config{Schema: schema, Batch: idempotency.BatchConfig{Disabled: true}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(store.Close)
	return &recordEnv{pool: pool, store: store, schema: schema, env: env}
}

// complete records a completed operation, then n duplicate deliveries of it.
func (e *recordEnv) complete(t *testing.T, task, key, result string, duplicates int) {
	t.Helper()
	ctx := context.Background()
	p := idempotency.ClaimParams{Task: task, Key: key, Owner: "test", TaskID: "id-" + key, Lease: time.Minute, Fingerprint: []byte("fp")}
	c, err := e.store.Claim(ctx, p)
	if err != nil || c.Outcome != idempotency.OutcomeFirst {
		t.Fatalf("claim %s %s: %v %v", task, key, c.Outcome, err)
	}
	if _, err := e.store.Complete(ctx, p.Ref(c.Token), []byte(result)); err != nil {
		t.Fatal(err)
	}
	for range duplicates {
		p.TaskID = "dup-" + key
		if c, err := e.store.Claim(ctx, p); err != nil || c.Outcome != idempotency.OutcomeCompleted {
			t.Fatalf("duplicate claim: %v %v", c.Outcome, err)
		}
	}
}

// hold records an operation held by its stale-claim policy.
func (e *recordEnv) hold(t *testing.T, task, key string) {
	t.Helper()
	ctx := context.Background()
	p := idempotency.ClaimParams{Task: task, Key: key, Owner: "test", TaskID: "id-" + key, Lease: time.Minute, Fingerprint: []byte("fp")}
	c, err := e.store.Claim(ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	// Its worker died: the lease lapsed, and the policy holds it.
	if _, err := e.pool.Exec(ctx, `UPDATE `+e.schema+`.records SET lease_until = now() - interval '1 second' WHERE task = $1 AND key = $2`, task, key); err != nil {
		t.Fatal(err)
	}
	if err := e.store.Hold(ctx, p.Ref(c.Token), nil, "stale claim, policy hold"); err != nil {
		t.Fatal(err)
	}
}

func TestMigrateCreatesTheSchemaAndIsRepeatable(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t)
	schema := testenv.Name("t")
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
	})
	env := map[string]string{"ONCELER_DATABASE_URL": testenv.DatabaseURL(t)}
	for range 2 {
		r := runIn(t, env, "migrate", "--schema", schema)
		if r.err != nil {
			t.Fatalf("migrate: %v", r.err)
		}
		if !strings.Contains(r.stdout, `schema "`+schema+`" is at version`) {
			t.Fatalf("migrate output: %q", r.stdout)
		}
	}
	var ok bool
	if err := pool.QueryRow(context.Background(), `SELECT to_regclass($1) IS NOT NULL`, schema+".records").Scan(&ok); err != nil || !ok {
		t.Fatalf("records table missing after migrate: %v", err)
	}
}

func TestRecordsListsFiltersAndInspects(t *testing.T) {
	t.Parallel()
	e := newRecordEnv(t)
	e.complete(t, "demo.ledger.credit", "e-1", `{"balance": 1500}`, 2)
	e.complete(t, "demo.ledger.credit", "e-2", `{"balance": 1750}`, 0)
	e.hold(t, "demo.email.send", "msg-1")

	r := runIn(t, e.env, "records")
	if r.err != nil {
		t.Fatal(r.err)
	}
	for _, want := range []string{"demo.ledger.credit", "e-1", "e-2", "demo.email.send", "msg-1", "held", "3 record(s)"} {
		if !strings.Contains(r.stdout, want) {
			t.Fatalf("records output misses %q:\n%s", want, r.stdout)
		}
	}

	r = runIn(t, e.env, "records", "--status", "held", "--json")
	if r.err != nil {
		t.Fatal(r.err)
	}
	var recs []recordJSON
	if err := json.Unmarshal([]byte(r.stdout), &recs); err != nil {
		t.Fatalf("records --json: %v\n%s", err, r.stdout)
	}
	if len(recs) != 1 || recs[0].Key != "msg-1" || recs[0].Status != "held" || recs[0].Reason != "stale claim, policy hold" {
		t.Fatalf("held records = %+v", recs)
	}

	r = runIn(t, e.env, "records", "--task", "demo.ledger.credit", "--key", "e-1")
	if r.err != nil {
		t.Fatal(r.err)
	}
	for _, want := range []string{"status:        completed", "duplicates:    2", `"balance": 1500`} {
		if !strings.Contains(r.stdout, want) {
			t.Fatalf("record detail misses %q:\n%s", want, r.stdout)
		}
	}

	// Flags after the environment: the flag wins.
	r = runIn(t, e.env, "records", "--schema", "no_such_schema_here")
	if r.err == nil || !strings.Contains(r.err.Error(), "does not exist: run 'onceler migrate'") {
		t.Fatalf("records on a missing schema: %v", r.err)
	}
	r = runIn(t, e.env, "records", "--status", "done")
	var u *usageError
	if !errors.As(r.err, &u) || !strings.Contains(r.err.Error(), "claimed, completed, failed, held, skipped") {
		t.Fatalf("records --status done: %v", r.err)
	}
}

func TestRepeatsReportsDuplicates(t *testing.T) {
	t.Parallel()
	e := newRecordEnv(t)
	r := runIn(t, e.env, "repeats", "--since", "1h")
	if r.err != nil || !strings.Contains(r.stdout, "no repeats in the last 1h") {
		t.Fatalf("repeats on an empty record: %v %q", r.err, r.stdout)
	}
	e.complete(t, "demo.ledger.credit", "e-1", `1`, 2)
	e.complete(t, "demo.payments.charge", "order-1", `1`, 1)
	e.hold(t, "demo.email.send", "msg-1")

	r = runIn(t, e.env, "repeats", "--since", "1h")
	if r.err != nil {
		t.Fatal(r.err)
	}
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	if len(lines) != 5 {
		t.Fatalf("repeats table has %d lines, want header, 3 tasks and total:\n%s", len(lines), r.stdout)
	}
	if f := strings.Fields(lines[4]); strings.Join(f, " ") != "total 3 0 1 0 0 0" {
		t.Fatalf("total line %q, want 3 duplicates and 1 held:\n%s", lines[4], r.stdout)
	}

	r = runIn(t, e.env, "repeats", "--since", "1d", "--json")
	if r.err != nil {
		t.Fatal(r.err)
	}
	var rep repeatsReport
	if err := json.Unmarshal([]byte(r.stdout), &rep); err != nil {
		t.Fatal(err)
	}
	got := map[string]repeatsTaskJSON{}
	for _, s := range rep.Tasks {
		got[s.Task] = s
	}
	if got["demo.ledger.credit"].Duplicates != 2 || got["demo.payments.charge"].Duplicates != 1 || got["demo.email.send"].Held != 1 {
		t.Fatalf("repeats --json = %+v", rep)
	}
	if time.Since(rep.Since) < 23*time.Hour {
		t.Fatalf("since = %v, want a day ago", rep.Since)
	}
}

func TestPurgeDryRunThenPurge(t *testing.T) {
	t.Parallel()
	e := newRecordEnv(t)
	ctx := context.Background()
	for _, k := range []string{"a", "b", "c", "d", "e"} {
		e.complete(t, "demo.ledger.credit", k, `1`, 0)
	}
	e.hold(t, "demo.email.send", "held-1")
	// Age everything but one record by two days.
	if _, err := e.pool.Exec(ctx, `UPDATE `+pgx.Identifier{e.schema, "records"}.Sanitize()+
		` SET updated_at = now() - interval '2 days' WHERE key <> 'e'`); err != nil {
		t.Fatal(err)
	}

	r := runIn(t, e.env, "purge", "--older-than", "1d", "--dry-run")
	if r.err != nil {
		t.Fatal(r.err)
	}
	if !strings.Contains(r.stdout, "dry run: would delete 4 records") || !strings.Contains(r.stdout, "demo.ledger.credit  completed  4") {
		t.Fatalf("dry run output:\n%s", r.stdout)
	}
	count := func() int {
		var n int
		if err := e.pool.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{e.schema, "records"}.Sanitize()).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := count(); n != 6 {
		t.Fatalf("dry run deleted records: %d left, want 6", n)
	}

	r = runIn(t, e.env, "purge", "--older-than", "1d", "--batch-size", "3")
	if r.err != nil {
		t.Fatal(r.err)
	}
	if !strings.Contains(r.stdout, "deleted 3 records") || !strings.Contains(r.stdout, "deleted 4 records and") {
		t.Fatalf("purge output (batches of 3, with progress):\n%s", r.stdout)
	}
	if n := count(); n != 2 {
		t.Fatalf("after purge %d records left, want 2 (the recent one and the held one)", n)
	}
	if _, err := e.store.Get(ctx, "demo.email.send", "held-1"); err != nil {
		t.Fatalf("held record purged: %v", err)
	}

	for _, args := range [][]string{{"purge"}, {"purge", "--older-than", "soon"}, {"purge", "--older-than", "-1h"}} {
		var u *usageError
		if r := runIn(t, e.env, args...); !errors.As(r.err, &u) {
			t.Fatalf("%v: got %v, want a usage error", args, r.err)
		}
	}
}

func TestResolveCompleted(t *testing.T) {
	t.Parallel()
	e := newRecordEnv(t)
	ctx := context.Background()
	e.hold(t, "demo.email.send", "msg-1")
	e.complete(t, "demo.email.send", "msg-2", `{"sent": true}`, 0)

	r := runIn(t, e.env, "resolve", "demo.email.send", "msg-1", "--completed", "--result", `{"sent": true, "by": "hand"}`)
	if r.err != nil {
		t.Fatal(r.err)
	}
	rec, err := e.store.Get(ctx, "demo.email.send", "msg-1")
	if err != nil {
		t.Fatal(err)
	}
	var res map[string]any
	if err := json.Unmarshal(rec.Result, &res); err != nil || rec.Status != idempotency.StatusCompleted || res["by"] != "hand" {
		t.Fatalf("resolved record: %s %s %v", rec.Status, rec.Result, err)
	}

	r = runIn(t, e.env, "resolve", "demo.email.send", "msg-2", "--completed")
	if r.err == nil || !strings.Contains(r.err.Error(), "is not held") {
		t.Fatalf("resolving a completed record: %v", r.err)
	}
	r = runIn(t, e.env, "resolve", "demo.email.send", "nope", "--completed")
	if r.err == nil || !strings.Contains(r.err.Error(), "no record") {
		t.Fatalf("resolving a missing record: %v", r.err)
	}
	for _, args := range [][]string{
		{"resolve", "demo.email.send", "msg-1"},
		{"resolve", "demo.email.send", "msg-1", "--completed", "--retry"},
		{"resolve", "demo.email.send", "--completed"},
		{"resolve", "demo.email.send", "msg-1", "--completed", "--result", "{bad"},
		{"resolve", "demo.email.send", "msg-1", "--retry", "--result", "1"},
	} {
		var u *usageError
		if r := runIn(t, e.env, args...); !errors.As(r.err, &u) {
			t.Fatalf("%v: got %v, want a usage error", args, r.err)
		}
	}
}
