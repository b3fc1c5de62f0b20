package cmd

import (
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
)

// 'migrate --print-grants' prints the GRANT statements of its roles and
// connects to nothing.
func TestMigratePrintGrants(t *testing.T) {
	t.Parallel()
	env := map[string]string{"ONCELER_DATABASE_URL": "postgres://nobody@127.0.0.1:1/none?connect_timeout=1"}
	r := runIn(t, env, "migrate", "--print-grants", "--schema", "rec", "--grant-to", "w1,w2", "--grant-admin-to", "ops")
	if r.err != nil {
		t.Fatalf("%v\n%s", r.err, r.stderr)
	}
	var want []string
	for _, g := range []struct {
		role  string
		privs []idempotency.Privilege
	}{{"w1", idempotency.WorkerPrivileges()}, {"w2", idempotency.WorkerPrivileges()}, {"ops", idempotency.AdminPrivileges()}} {
		for _, q := range idempotency.GrantStatements("rec", g.role, g.privs) {
			want = append(want, q+";")
		}
	}
	if got := strings.TrimSpace(r.stdout); got != strings.Join(want, "\n") {
		t.Fatalf("stdout:\n%s\nwant:\n%s", got, strings.Join(want, "\n"))
	}
	if !strings.Contains(r.stdout, `GRANT SELECT, INSERT, UPDATE ON TABLE "rec".records TO "w1";`) {
		t.Fatalf("no records grant for w1:\n%s", r.stdout)
	}
	if r := runIn(t, env, "migrate", "--print-grants"); r.err == nil || !strings.Contains(r.err.Error(), "--print-grants needs --grant-to or --grant-admin-to") {
		t.Fatalf("--print-grants alone: %v", r.err)
	}
	// It reads no secret file either: one the host cannot read is no error.
	gone := map[string]string{"ONCELER_DATABASE_URL_FILE": "/nonexistent/onceler-db-url"}
	if r := runIn(t, gone, "migrate", "--print-grants", "--schema", "rec", "--grant-to", "w1"); r.err != nil || !strings.Contains(r.stdout, `TO "w1";`) {
		t.Fatalf("--print-grants with an unreadable ONCELER_DATABASE_URL_FILE: %v\n%s", r.err, r.stdout)
	}
	if r := runIn(t, gone, "migrate", "--schema", "rec", "--grant-to", "w1"); r.err == nil || !strings.Contains(r.err.Error(), "cannot read --database-url-file /nonexistent/onceler-db-url") {
		t.Fatalf("migrate with an unreadable ONCELER_DATABASE_URL_FILE: %v", r.err)
	}
	if r := runIn(t, map[string]string{"ONCELER_PRINT_GRANTS": "true"}, "migrate", "--grant-to", "w", "--database-url", env["ONCELER_DATABASE_URL"]); r.err == nil || !strings.Contains(r.err.Error(), "cannot reach PostgreSQL") {
		t.Fatalf("ONCELER_PRINT_GRANTS must be ignored (command line only): %v", r.err)
	}
}

// A worker role given its privileges by 'onceler migrate --grant-to' runs
// tasks as that role; with one privilege revoked, 'onceler worker' exits at
// start with status 1 and one line naming it and the command that grants
// it, and so do records and repeats for theirs.
func TestWorkerRoleGrants(t *testing.T) {
	t.Parallel()
	s := newStack(t)
	pool := testenv.Pool(t)
	role, roleURL := testenv.Role(t, pool)
	if r := runBin(t, s.env, "migrate", "--grant-to", role); r.code != 0 || !strings.Contains(r.stdout, `role "`+role+`" has the worker privileges on schema "`+s.schema+`"`) {
		t.Fatalf("migrate --grant-to: %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	asRole := s.with(map[string]string{"ONCELER_DATABASE_URL": roleURL})

	// The worker runs a task as the role (no --migrate: the role may not).
	w := start(t, "worker", asRole, binary, "worker")
	w.waitLog("consuming", 60*time.Second)
	_, replies := s.sendTasks(t, 60*time.Second, call{demo.TaskAdd, []any{2, 3}}, call{demo.TaskAdd, []any{2, 3}}).replies(90 * time.Second)
	if len(replies) != 2 || replies[0].OK != float64(5) || replies[1].OK != float64(5) {
		t.Fatalf("replies %+v", replies)
	}
	w.stop()
	if r := runBin(t, asRole, "records", "--task", demo.TaskAdd); r.code != 0 {
		t.Fatalf("records as the worker role: %d\n%s", r.code, r.stderr)
	}
	r := runBin(t, asRole, "repeats")
	line := oneLineError(t, r, 1)
	want := `onceler: PostgreSQL role "` + role + `" lacks SELECT on TABLE "` + s.schema + `".events, which 'onceler repeats' needs: run 'onceler migrate --schema ` + s.schema + ` --grant-admin-to ` + role + `' as the schema's owner (docs/security.md)`
	if line != want {
		t.Errorf("repeats as the worker role:\n%s\nwant\n%s", line, want)
	}

	testenv.Grant(t, pool, "REVOKE UPDATE ON "+s.schema+".records FROM "+pgx.Identifier{role}.Sanitize())
	begin := time.Now()
	r = runBin(t, asRole, "worker")
	line = oneLineError(t, r, 1)
	want = `onceler: PostgreSQL role "` + role + `" lacks UPDATE on TABLE "` + s.schema + `".records, which 'onceler worker' needs: run 'onceler migrate --schema ` + s.schema + ` --grant-to ` + role + `' as the schema's owner (docs/security.md)`
	if line != want {
		t.Errorf("worker without UPDATE:\n%s\nwant\n%s", line, want)
	}
	if took := time.Since(begin); took > 15*time.Second {
		t.Errorf("took %v to refuse", took)
	}
	// migrate --grant-to on the current schema grants it again.
	if r := runBin(t, s.env, "migrate", "--grant-to", role); r.code != 0 {
		t.Fatalf("migrate --grant-to again: %d\n%s", r.code, r.stderr)
	}
	testenv.Grant(t, pool, "REVOKE USAGE ON SCHEMA "+s.schema+" FROM "+pgx.Identifier{role}.Sanitize())
	r = runBin(t, asRole, "records")
	if line := oneLineError(t, r, 1); !strings.Contains(line, `lacks USAGE on SCHEMA "`+s.schema+`"`) || !strings.Contains(line, "--grant-to "+role) {
		t.Errorf("records without USAGE: %s", line)
	}
}
