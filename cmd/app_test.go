package cmd

import (
	"bytes"
	"context"
	"strings"
	"testing"

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
