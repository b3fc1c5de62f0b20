package cmd

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
)

// TestDatabaseURLFileWithTwoLinesKeepsPasswordOut: a secret file holding
// its URL twice (a second line pasted by mistake, or an old and a new
// one) is taken whole, newline included; the error that follows must
// still not show the password. readSecrets trims only the trailing
// newline, and describeDB then names the "database" x\npostgres://u:PW@...
func TestDatabaseURLFileWithTwoLinesKeepsPasswordOut(t *testing.T) {
	t.Parallel()
	const pw = "Two-Line-Pw-5d1e"
	line := "postgres://u:" + pw + "@127.0.0.1:1/x"
	path := writeSecret(t, "db", line+"\n"+line+"\n")
	for _, args := range [][]string{{"records"}, {"purge", "--older-than", "1d", "--dry-run"}} {
		r := runIn(t, map[string]string{"ONCELER_DATABASE_URL_FILE": path}, args...)
		if r.err == nil {
			t.Fatalf("%v: no error", args)
		}
		if out := r.err.Error() + r.stderr; strings.Contains(out, pw) {
			t.Errorf("%v: the error holds the password of the file's second line: %s", args, out)
		}
	}
}

// TestDjangoBackendFileWithTwoLinesKeepsPasswordOut: the same file
// mistake with --result-backend-file (django-db): the worker refuses to
// start (a secret file holds one line; more is the usage error naming the
// path), and what it prints must not show the password.
func TestDjangoBackendFileWithTwoLinesKeepsPasswordOut(t *testing.T) {
	t.Parallel()
	s := newStack(t)
	const pw = "Django-Two-Line-Pw-8c2f"
	u, err := url.Parse(testenv.DatabaseURL(t))
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword(u.User.Username(), pw) // trust auth: sent to no one
	u.RawQuery = ""
	line := "django-db+" + u.String()
	path := writeSecret(t, "rb", line+"\n"+line+"\n")
	env := s.with(map[string]string{"ONCELER_RESULT_BACKEND_FILE": path})
	r := runBin(t, env, "worker", "--migrate")
	if logs := r.stdout + r.stderr; strings.Contains(logs, pw) {
		t.Errorf("the worker's log holds the django-db backend's password:\n%s", logs)
	}
	if line := oneLineError(t, r, 2); !strings.Contains(line, "--result-backend-file "+path+" holds more than one line") {
		t.Errorf("the worker's line %q does not name the file holding more than one line", line)
	}
}

// TestDjangoBackendPrivilegesCheckedAtStart: a worker whose django-db
// backend (same database, the worker's role) may read
// django_celery_results_taskresult but not write it is told so at start,
// not per message: docs/security.md lists INSERT and UPDATE as needed, and
// the backend's start ping reads the table only, logs it healthy ("result
// backend") and every result then fails ("permission denied").
func TestDjangoBackendPrivilegesCheckedAtStart(t *testing.T) {
	t.Parallel()
	s := newStack(t)
	pool := testenv.Pool(t)
	ctx := context.Background()
	djSchema := testenv.Schema(t, pool)
	if _, err := pool.Exec(ctx, `CREATE TABLE `+djSchema+`.django_celery_results_taskresult (
    id serial PRIMARY KEY, task_id varchar(255) UNIQUE NOT NULL, status varchar(50) NOT NULL,
    content_type varchar(128) NOT NULL, content_encoding varchar(64) NOT NULL, result text,
    date_done timestamptz NOT NULL, traceback text, meta text, task_args text, task_kwargs text,
    task_name varchar(255), worker varchar(100), date_created timestamptz NOT NULL,
    periodic_task_name varchar(255))`); err != nil {
		t.Fatal(err)
	}
	role, roleURL := testenv.Role(t, pool)
	r := pgx.Identifier{role}.Sanitize()
	if res := runBin(t, s.env, "migrate", "--grant-to", role); res.code != 0 {
		t.Fatalf("migrate --grant-to: %s", res.stderr)
	}
	testenv.Grant(t, pool, "GRANT USAGE ON SCHEMA "+djSchema+" TO "+r)
	testenv.Grant(t, pool, "GRANT SELECT ON "+djSchema+".django_celery_results_taskresult TO "+r)
	bu, err := url.Parse(roleURL)
	if err != nil {
		t.Fatal(err)
	}
	q := bu.Query()
	q.Set("search_path", djSchema)
	bu.RawQuery = q.Encode()
	env := s.with(map[string]string{"ONCELER_DATABASE_URL": roleURL, "ONCELER_RESULT_BACKEND": "django-db+" + bu.String()})
	w := start(t, "worker", env, binary, "worker")
	w.waitLog("consuming", 60*time.Second)
	startLog := w.stderr.String()
	s.sendTasks(t, time.Second, call{demo.TaskAdd, []any{1, 2}})
	w.waitLog("permission denied", 60*time.Second) // the worker is killed at cleanup
	if !strings.Contains(startLog, "result backend does not answer yet") {
		t.Errorf("the worker started with a django-db backend its role cannot write (no warning at start), and each result then fails: %s",
			firstLineWith(w.stderr.String(), "permission denied"))
	}
}

// firstLineWith returns the first line of logs that holds s.
func firstLineWith(logs, s string) string {
	for _, l := range strings.Split(logs, "\n") {
		if strings.Contains(l, s) {
			return l
		}
	}
	return ""
}

// TestBlankDatabaseURLFileIsEmpty: a secret file holding only blanks (a
// template that rendered an unset value as " \n") is as empty as one
// holding "\n": it must be the usage error naming the path, not a
// --database-url of " ", which pgx reads as no setting at all and the
// command then connects to the libpq defaults (another database than the
// file was meant to name).
func TestBlankDatabaseURLFileIsEmpty(t *testing.T) {
	t.Parallel()
	for _, content := range []string{" \n", "\t\r\n"} {
		path := writeSecret(t, "db", content)
		r := runIn(t, map[string]string{"ONCELER_DATABASE_URL_FILE": path}, "records")
		if ExitCode(r.err) != 2 || !strings.Contains(fmt.Sprint(r.err), "--database-url-file "+path+" is empty") {
			t.Errorf("file %q: %v (exit %d), want the usage error %q", content, r.err, ExitCode(r.err), "--database-url-file "+path+" is empty")
		}
	}
}

// TestPurgeAsRoleWithDocumentedPrivileges: 'onceler purge' run as a role
// holding what docs/security.md lists for it ("USAGE, SELECT and DELETE on
// records, events, attempts", idempotency.PurgePrivileges, what purge
// checks at start) passes the start check and must then purge. It fails
// after the check instead: the purge selects the records FOR UPDATE,
// which needs UPDATE on records too.
func TestPurgeAsRoleWithDocumentedPrivileges(t *testing.T) {
	t.Parallel()
	s := newStack(t)
	pool := testenv.Pool(t)
	role, roleURL := testenv.Role(t, pool)
	if r := runBin(t, s.env, "migrate"); r.code != 0 {
		t.Fatalf("migrate: %s", r.stderr)
	}
	for _, q := range idempotency.GrantStatements(s.schema, role, idempotency.PurgePrivileges()) {
		testenv.Grant(t, pool, q)
	}
	r := runBin(t, s.with(map[string]string{"ONCELER_DATABASE_URL": roleURL}), "purge", "--older-than", "1d")
	if r.code != 0 {
		t.Errorf("purge as a role with the purge privileges: exit %d: %s", r.code, strings.TrimSpace(r.stderr))
	}
}

// TestConcurrentMigrateGrantTo: 'onceler migrate' says it is "safe to run
// again and from several machines at once" (each replica's init step
// running 'migrate --grant-to worker', say). PostgreSQL refuses concurrent
// GRANTs on one object ("tuple concurrently updated"), so the grants must
// run under the migration's advisory lock: none of the migrates may exit
// with an error.
func TestConcurrentMigrateGrantTo(t *testing.T) {
	t.Parallel()
	s := newStack(t)
	pool := testenv.Pool(t)
	role, _ := testenv.Role(t, pool)
	if r := runIn(t, s.env, "migrate"); r.err != nil {
		t.Fatalf("migrate: %v", r.err)
	}
	const procs, rounds = 8, 20
	errs := make(chan error, procs*rounds)
	done := make(chan struct{})
	for range procs {
		go func() {
			defer func() { done <- struct{}{} }()
			for range rounds {
				if r := runIn(t, s.env, "migrate", "--grant-to", role); r.err != nil {
					errs <- r.err
				}
			}
		}()
	}
	for range procs {
		<-done
	}
	close(errs)
	n, first := 0, error(nil)
	for err := range errs {
		if first == nil {
			first = err
		}
		n++
	}
	if n > 0 {
		t.Errorf("%d of %d concurrent 'migrate --grant-to' failed; first: %v", n, procs*rounds, first)
	}
}

// TestPrivilegeHintWorksForRoleWithSpace: the line that refuses a role
// lacking a grant says which command grants it ("run 'onceler migrate
// --schema S --grant-to ROLE'"). For a role whose name holds a space (a
// name PostgreSQL allows, and GrantStatements quotes), the command as
// printed, run by a shell, must grant that role; the role name is printed
// unquoted, so the shell splits it and migrate refuses the rest as an
// unexpected argument.
func TestPrivilegeHintWorksForRoleWithSpace(t *testing.T) {
	t.Parallel()
	s := newStack(t)
	pool := testenv.Pool(t)
	role := "Ops Team " + testenv.Name("r")
	id := pgx.Identifier{role}.Sanitize()
	testenv.Grant(t, pool, "CREATE ROLE "+id+" LOGIN")
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), "DROP OWNED BY "+id)
		_, _ = pool.Exec(context.Background(), "DROP ROLE "+id)
	})
	if r := runBin(t, s.env, "migrate"); r.code != 0 {
		t.Fatalf("migrate: %s", r.stderr)
	}
	u, err := url.Parse(testenv.DatabaseURL(t))
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(role)
	asRole := s.with(map[string]string{"ONCELER_DATABASE_URL": u.String()})
	line := oneLineError(t, runBin(t, asRole, "records"), 1)
	_, hint, _ := strings.Cut(line, "run '")
	hint, _, ok := strings.Cut(hint, "' as the schema's owner")
	if !ok {
		t.Fatalf("no command in the line: %s", line)
	}
	args := shellWords(t, hint)
	if len(args) < 2 || args[0] != "onceler" {
		t.Fatalf("hint %q", hint)
	}
	if r := runBin(t, s.env, args[1:]...); r.code != 0 {
		t.Fatalf("the hint's command %q, run as a shell runs it: exit %d: %s", hint, r.code, strings.TrimSpace(r.stderr))
	}
	if r := runBin(t, asRole, "records"); r.code != 0 {
		t.Fatalf("records after the hint's grant: %s", r.stderr)
	}
}

// shellWords splits s as a POSIX shell does for words with single or
// double quotes and backslashes (no expansions).
func shellWords(t *testing.T, s string) []string {
	t.Helper()
	var out []string
	var cur strings.Builder
	in, quote := false, byte(0)
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case quote == '\'':
			if c == '\'' {
				quote = 0
			} else {
				cur.WriteByte(c)
			}
		case quote == '"':
			if c == '"' {
				quote = 0
			} else if c == '\\' && i+1 < len(s) {
				i++
				cur.WriteByte(s[i])
			} else {
				cur.WriteByte(c)
			}
		case c == '\'' || c == '"':
			quote, in = c, true
		case c == '\\' && i+1 < len(s):
			i++
			cur.WriteByte(s[i])
			in = true
		case c == ' ' || c == '\t':
			if in {
				out = append(out, cur.String())
				cur.Reset()
				in = false
			}
		default:
			cur.WriteByte(c)
			in = true
		}
	}
	if quote != 0 {
		t.Fatalf("unterminated quote in %q", s)
	}
	if in {
		out = append(out, cur.String())
	}
	return out
}
