package cmd

import (
	"bytes"
	"context"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
)

// A user's own worker binary (the library's tasks.NewWorker and Run) on a
// database whose record schema was never migrated exits at start with one
// line naming the schema and the command that applies it, instead of
// holding its deliveries silently.
func TestUserWorkerRefusesMissingSchema(t *testing.T) {
	t.Parallel()
	s := newStack(t)
	r, start := runUserWorker(t, s.env)
	line := oneLineError(t, r, 1)
	for _, want := range []string{`record schema "` + s.schema + `" does not exist`, "onceler migrate --schema " + s.schema, "--migrate"} {
		if !strings.Contains(line, want) {
			t.Errorf("stderr %q does not say %q", line, want)
		}
	}
	if took := time.Since(start); took > 15*time.Second {
		t.Errorf("took %v to refuse", took)
	}
}

// A user's own worker binary connected as a role that lacks a privilege on
// the record exits at start with one line naming it and how to grant it.
func TestUserWorkerRefusesMissingGrant(t *testing.T) {
	t.Parallel()
	s := newStack(t)
	pool := testenv.Pool(t)
	role, roleURL := testenv.Role(t, pool)
	if r := runBin(t, s.env, "migrate", "--grant-to", role); r.code != 0 {
		t.Fatalf("migrate --grant-to: %s", r.stderr)
	}
	testenv.Grant(t, pool, "REVOKE INSERT ON "+s.schema+".events FROM "+pgx.Identifier{role}.Sanitize())
	r, _ := runUserWorker(t, s.with(map[string]string{"ONCELER_DATABASE_URL": roleURL}))
	line := oneLineError(t, r, 1)
	for _, want := range []string{`role "` + role + `" lacks INSERT on TABLE "` + s.schema + `".events`, "'onceler migrate --schema " + s.schema + " --grant-to " + role + "'"} {
		if !strings.Contains(line, want) {
			t.Errorf("stderr %q does not say %q", line, want)
		}
	}
}

// runUserWorker builds testdata/userworker (a worker wired with
// tasks.NewWorker) and runs it with env until it exits, within 30 s.
func runUserWorker(t *testing.T, env map[string]string) (result, time.Time) {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "userworker")
	args := []string{"build", "-o", bin}
	if raceEnabled {
		args = append(args, "-race")
	}
	if out, err := exec.Command("go", append(args, "./testdata/userworker")...).CombinedOutput(); err != nil {
		t.Fatalf("build userworker: %v\n%s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin)
	cmd.Env = processEnv(env)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	start := time.Now()
	err := cmd.Run()
	if ctx.Err() != nil {
		t.Fatalf("the worker did not exit within 30s (err %v); stderr:\n%s", err, errOut.String())
	}
	return result{stdout: out.String(), stderr: errOut.String(), err: err, code: cmd.ProcessState.ExitCode()}, start
}

// The worker command checks the record schema after --migrate would have
// applied it: a missing or old schema is one line naming 'onceler migrate'
// and --migrate.
func TestWorkerCommandSchemaCheck(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t)
	schema := testenv.Schema(t, pool)
	store, err := idempotency.New(pool, idempotency.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	ctx := context.Background()
	err = checkSchema(ctx, "onceler", store, schema)
	want := `the record schema "` + schema + `" does not exist: run 'onceler migrate' (same --database-url and --schema) or start the worker with --migrate`
	if err == nil || err.Error() != want {
		t.Fatalf("missing schema: %v, want %q", err, want)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if err := checkSchema(ctx, "onceler", store, schema); err != nil {
		t.Fatalf("migrated schema: %v", err)
	}
	if _, err := pool.Exec(ctx, `DELETE FROM "`+schema+`".migrations WHERE version = (SELECT max(version) FROM "`+schema+`".migrations)`); err != nil {
		t.Fatal(err)
	}
	if err := checkSchema(ctx, "onceler", store, schema); err == nil || !strings.Contains(err.Error(), "this binary needs") || !strings.Contains(err.Error(), "run 'onceler migrate'") {
		t.Fatalf("old schema: %v", err)
	}
}

// 'onceler worker' on a database whose record schema was never migrated,
// started without --migrate, exits with status 1 and one line naming the
// schema and the two ways to apply it; nothing is consumed meanwhile.
func TestWorkerProcessRefusesMissingSchema(t *testing.T) {
	t.Parallel()
	s := newStack(t)
	start := time.Now()
	r := runBin(t, s.env, "worker")
	line := oneLineError(t, r, 1)
	want := `onceler: the record schema "` + s.schema + `" does not exist: run 'onceler migrate' (same --database-url and --schema) or start the worker with --migrate`
	if line != want {
		t.Errorf("stderr %q\nwant   %q", line, want)
	}
	if took := time.Since(start); took > 15*time.Second {
		t.Errorf("took %v to refuse", took)
	}
}
