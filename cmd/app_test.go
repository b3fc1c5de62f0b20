package cmd

import (
	"bytes"
	"context"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/tasks"
)

// A binary of its own gets the whole command under its own name: help and
// messages name it, and a worker without tasks is a usage error.
func TestAppNamesItself(t *testing.T) {
	t.Parallel()
	var out, errOut bytes.Buffer
	app := App{Name: "refunds"}
	if err := app.Run(context.Background(), []string{"help"}, &out, &errOut); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(out.String(), "refunds runs Celery tasks") || !strings.Contains(out.String(), "Usage: refunds COMMAND") ||
		strings.Contains(out.String(), "onceler COMMAND") {
		t.Errorf("help:\n%s", out.String())
	}
	out.Reset()
	if err := app.Run(context.Background(), []string{"migrate", "--help"}, &out, &errOut); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(out.String(), "Usage: refunds migrate [flags]") || !strings.Contains(out.String(), "(env ONCELER_SCHEMA, default onceler)") {
		t.Errorf("migrate --help:\n%s", out.String())
	}
	out.Reset()
	err := app.Run(context.Background(), []string{"worker", "--queues", "q"}, &out, &errOut)
	if ExitCode(err) != 2 {
		t.Fatalf("worker without Register: %v, exit %d", err, ExitCode(err))
	}
	want := "refunds: worker: no tasks to serve: this binary's cmd.App has no Register function (run 'refunds worker --help')\n"
	if errOut.String() != want {
		t.Errorf("stderr %q, want %q", errOut.String(), want)
	}
}

func TestExitCode(t *testing.T) {
	t.Parallel()
	if ExitCode(nil) != 0 || ExitCode(usagef("x", "y")) != 2 || ExitCode(context.Canceled) != 1 {
		t.Error("exit codes")
	}
}

// Register's error, and a Register that adds nothing, stop the worker with
// a message that says so.
func TestAppRegisterFailures(t *testing.T) {
	t.Parallel()
	s := newStack(t)
	for _, tc := range []struct {
		reg  func(context.Context, *tasks.Registry, Env) error
		want string
	}{
		{func(context.Context, *tasks.Registry, Env) error { return context.DeadlineExceeded }, "register the tasks: context deadline exceeded"},
		{func(context.Context, *tasks.Registry, Env) error { return nil }, "no tasks to serve: Register added none to the registry"},
	} {
		var out, errOut bytes.Buffer
		a := newApp(App{Name: "mine", Register: tc.reg}, &out, &errOut, func(k string) string { return s.env[k] })
		err := a.run(context.Background(), []string{"worker", "--migrate"})
		if err == nil || !strings.Contains(err.Error(), tc.want) || ExitCode(err) != 1 {
			t.Errorf("err %v, want %q", err, tc.want)
		}
	}
}

// edgeApp is a binary of one's own built on cmd.Main: the program
// cmd/testdata/edgeapp (Name "payments") whose Register and Migrate
// misbehave as EDGE_REGISTER and EDGE_MIGRATE ask.
var edgeApp builtBinary

// edgeBinary builds cmd/testdata/edgeapp once per run.
func edgeBinary(t *testing.T) string { return edgeApp.get(t, "payments", ".", "./testdata/edgeapp") }

// A Migrate or Register that panics is a failure of the binary, not a usage
// error: cmd.Main promises status 2 only for usage errors and 1 for any
// other failure, with one line on stderr naming the program.
func TestOwnBinaryPanicInMigrateOrRegisterExitsOneWithOneLine(t *testing.T) {
	t.Parallel()
	s := newExampleStack(t)
	bin := edgeBinary(t)
	for _, c := range []struct {
		name string
		env  map[string]string
		args []string
	}{
		{"Migrate panics in migrate", map[string]string{"EDGE_MIGRATE": "panic"}, []string{"migrate"}},
		{"Migrate panics in worker --migrate", map[string]string{"EDGE_MIGRATE": "panic"}, []string{"worker", "--migrate"}},
		{"Register panics in worker", map[string]string{"EDGE_REGISTER": "panic"}, []string{"worker", "--migrate"}},
	} {
		r := runProg(t, bin, s.with(c.env), c.args...)
		lines := strings.Split(strings.TrimRight(r.stderr, "\n"), "\n")
		first := lines[0]
		if r.code != 1 || len(lines) != 1 || strings.Contains(r.stderr, "goroutine ") || !strings.HasPrefix(first, "payments: ") {
			t.Errorf("%s: exit %d (want 1: not a usage error), %d line(s) on stderr (want one, \"payments: ...\"), first: %q",
				c.name, r.code, len(lines), first)
		}
	}
}

// The error of the binary's own Migrate reaches the operator whole: the
// context it wrapped around the database's error (which table, which step)
// is what tells them what failed.
func TestOwnBinaryMigrateErrorKeepsItsContext(t *testing.T) {
	t.Parallel()
	s := newExampleStack(t)
	bin := edgeBinary(t)
	r := runProg(t, bin, s.with(map[string]string{"EDGE_MIGRATE": "error"}), "migrate")
	line := oneLineError(t, r, 1)
	if !strings.Contains(line, "create table edge_payments") || !strings.Contains(line, `type "no_such_type" does not exist`) {
		t.Errorf("stderr %q\ndoes not carry Migrate's own error, %q", line,
			`create table edge_payments: ERROR: type "no_such_type" does not exist (SQLSTATE 42704)`)
	}
}

// App.Name documents "empty means the base name of the executable"; Run
// (exported, for programs that handle their own exit) names the program
// so too.
func TestAppRunEmptyNameIsTheExecutable(t *testing.T) {
	t.Parallel()
	var out, errOut bytes.Buffer
	if err := (App{}).Run(context.Background(), []string{"help"}, &out, &errOut); err != nil {
		t.Fatal(err)
	}
	exe := filepath.Base(os.Args[0])
	if first, _, _ := strings.Cut(out.String(), "\n"); !strings.HasPrefix(first, exe+" runs Celery tasks") {
		t.Errorf("help of App{} run as %s begins %q, want it to name %q", exe, first, exe)
	}
}

// The help of a binary of one's own does not describe the onceler binary's
// demo tasks and tables as its own.
func TestOwnBinaryHelpDoesNotClaimTheDemo(t *testing.T) {
	t.Parallel()
	app := App{Name: "refunds"}
	for _, cmdName := range []string{"worker", "migrate"} {
		var out, errOut bytes.Buffer
		if err := app.Run(context.Background(), []string{cmdName, "--help"}, &out, &errOut); err != nil {
			t.Fatal(err)
		}
		help := strings.Join(strings.Fields(out.String()), " ")
		for _, bad := range []string{"The refunds binary serves the demo tasks", "refunds binary, the demo tables in schema onceler_demo"} {
			if strings.Contains(help, bad) {
				t.Errorf("refunds %s --help says %q", cmdName, bad)
			}
		}
	}
}

// What the worker of a binary of one's own tells callers and operators
// names that binary's commands: a held operation's caller is told to run
// "payments resolve", "payments records" shows the kept message for
// "payments resolve --retry", and a dropped record logs "payments migrate".
// There is no onceler binary on such a machine.
func TestOwnBinaryMessagesNameTheProgram(t *testing.T) {
	t.Parallel()
	s := newExampleStack(t)
	bin := edgeBinary(t)
	ctx := context.Background()
	pool := testenv.Pool(t)
	if r := runProg(t, bin, s.env, "migrate"); r.code != 0 {
		t.Fatalf("payments migrate: exit %d\n%s", r.code, r.stderr)
	}

	// A worker died holding the claim of order-held (an outside task): its
	// lease lapsed, and the default policy holds the operation.
	store, err := idempotency.New(pool, idempotency.Config{Schema: s.schema})
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	p := idempotency.ClaimParams{Task: "edge.pay", Key: "order-held", Owner: "dead@host", TaskID: "dead-task", Lease: time.Minute}
	if _, err := store.Claim(ctx, p); err != nil {
		t.Fatal(err)
	}
	records := pgx.Identifier{s.schema, "records"}.Sanitize()
	if _, err := pool.Exec(ctx, `UPDATE `+records+` SET lease_until = now() - interval '1 second' WHERE task = 'edge.pay' AND key = 'order-held'`); err != nil {
		t.Fatal(err)
	}

	w := start(t, "payments worker", s.env, bin, "worker")
	w.waitLog("consuming", 60*time.Second)
	_, replies := s.sendTasks(t, time.Minute, call{"edge.pay", []any{"order-held"}}).replies(90 * time.Second)
	if len(replies) != 1 || replies[0].Error != "OperationHeld" {
		t.Fatalf("replies %+v, want OperationHeld", replies)
	}
	if msg := replies[0].Message; !strings.Contains(msg, "payments resolve") {
		t.Errorf("the caller of the held operation is told %q: it names 'onceler resolve', a program this machine does not have, not 'payments resolve'", msg)
	}

	r := runProg(t, bin, s.env, "records", "--task", "edge.pay", "--key", "order-held")
	if r.code != 0 || !strings.Contains(r.stdout, "status:") {
		t.Fatalf("payments records: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	for _, line := range strings.Split(r.stdout, "\n") {
		if strings.HasPrefix(line, "message:") && !strings.Contains(line, "'payments resolve --retry'") {
			t.Errorf("payments records shows %q, want it to name 'payments resolve --retry'", line)
		}
	}

	// The record's table goes away under the running worker.
	if _, err := pool.Exec(ctx, `DROP TABLE `+records+` CASCADE`); err != nil {
		t.Fatal(err)
	}
	sender := s.sendTasks(t, 5*time.Second, call{"edge.pay", []any{"order-2"}})
	w.waitLog("record schema missing", 60*time.Second)
	for _, line := range strings.Split(w.stderr.String(), "\n") {
		if strings.Contains(line, "record schema missing") && !strings.Contains(line, "'payments migrate'") {
			t.Errorf("the worker logs %s\nwant it to name 'payments migrate'", line)
			break
		}
	}
	_, _ = sender.replies(time.Minute)
	w.stop()
}

// 'migrate --help' says the command is safe from several machines at once
// because advisory locks serialise both steps, App.Migrate included: six
// 'payments migrate' at once whose Migrate is one CREATE TABLE IF NOT
// EXISTS, without a lock of its own, do not collide in PostgreSQL's catalog.
func TestOwnBinaryConcurrentMigrateIsSerialisedAsHelpSays(t *testing.T) {
	t.Parallel()
	bin := edgeBinary(t)
	var out, errOut bytes.Buffer
	if err := (App{Name: "payments"}).Run(context.Background(), []string{"migrate", "--help"}, &out, &errOut); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(strings.Join(strings.Fields(out.String()), " "), "from several machines at once (advisory locks serialise both steps)") {
		t.Fatalf("migrate --help no longer makes the claim:\n%s", out.String())
	}
	for round := range 8 {
		s := newExampleStack(t)
		var wg sync.WaitGroup
		res := make([]result, 6)
		for i := range res {
			wg.Go(func() { res[i] = runProg(t, bin, s.with(map[string]string{"EDGE_MIGRATE": "naive"}), "migrate") })
		}
		wg.Wait()
		for i, r := range res {
			if r.code != 0 {
				t.Errorf("round %d, run %d of 6 at once: exit %d: %s", round, i, r.code, strings.TrimSpace(r.stderr))
			}
		}
	}
}

// The program's name replaces "onceler" in the texts of a binary of its
// own, never in an error's names: with the default record schema, onceler,
// a role without rights on it must not read "lacks USAGE on SCHEMA
// payments", a schema that does not exist.
func TestOwnBinaryErrorKeepsTheSchemaName(t *testing.T) {
	t.Parallel()
	bin := edgeBinary(t)
	ctx := context.Background()
	pool := testenv.Pool(t)
	db, role := testenv.Name("db"), testenv.Name("role")
	if _, err := pool.Exec(ctx, "CREATE DATABASE "+db); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP DATABASE IF EXISTS "+db+" WITH (FORCE)") })
	if _, err := pool.Exec(ctx, "CREATE ROLE "+role+" LOGIN"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP ROLE IF EXISTS "+role) })
	u, err := url.Parse(testenv.DatabaseURL(t))
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + db
	conn, err := pgx.Connect(ctx, u.String())
	if err != nil {
		t.Fatal(err)
	}
	// The record schema, onceler (the default), made by its owner.
	_, err = conn.Exec(ctx, "CREATE SCHEMA onceler")
	_ = conn.Close(ctx)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(role)
	r := runProg(t, bin, map[string]string{"ONCELER_DATABASE_URL": u.String()}, "records")
	line := oneLineError(t, r, 1)
	for _, want := range []string{`lacks USAGE on SCHEMA "onceler"`, "'payments migrate --schema onceler --grant-to " + role + "'"} {
		if !strings.Contains(line, want) {
			t.Errorf("stderr %q\nwant the schema's own name: %s", line, want)
		}
	}
}
