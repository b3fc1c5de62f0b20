// Package cmd is the onceler command as a library: a binary that serves its
// own Celery tasks gets every subcommand of onceler (worker, migrate,
// records, resolve, repeats, purge, quarantine, version, help) with all their
// flags and ONCELER_* variables, by handing its tasks to Main:
//
//	func main() {
//		cmd.Main(cmd.App{
//			Name:     "refunds",
//			Register: register, // adds the binary's tasks to the registry
//			Migrate:  migrate,  // creates the binary's own tables
//		})
//	}
//
// The onceler binary is this same entry point with the demo tasks.
package cmd

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"

	"github.com/onceler/onceler/tasks"
)

// App is a worker binary: its name and its tasks.
type App struct {
	// Name is the program's name in help texts and messages; empty means
	// the base name of the executable.
	Name string

	// Register adds the binary's tasks to reg. The worker command calls it
	// once at start, after the record schema was checked, with the pool it
	// uses and its logger. It is required by the worker command.
	Register func(ctx context.Context, reg *tasks.Registry, env Env) error

	// Migrate creates or updates the binary's own tables (what its tasks
	// write to), after the record schema: run by the migrate command and by
	// "worker --migrate", under an advisory lock so that processes started
	// at once run it one after another. It must be safe to run again. Nil
	// means the binary has no tables of its own.
	Migrate func(ctx context.Context, pool *pgxpool.Pool) error
}

// callUser runs one of the binary's own functions (Register, Migrate): a
// panic in it is that function's failure, reported as an error, not a crash
// of the command with a stack trace.
func callUser(what string, f func() error) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("%s panicked: %v", what, p)
		}
	}()
	return f()
}

// Env is what Register is given: the worker's PostgreSQL pool (the one
// the record uses) and its logger.
type Env struct {
	Pool   *pgxpool.Pool
	Logger *zap.Logger
}

// Main runs the command line of the process (os.Args) and exits: status 0
// when the command succeeded, 2 for a usage error (an unknown command or
// flag, an invalid value), 1 for any other failure. SIGINT or SIGTERM asks
// the command to stop gracefully; a second one ends the process at once.
func Main(app App) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	// The first signal asks for a graceful shutdown; restoring the default
	// handling then lets a second signal end the process at once.
	context.AfterFunc(ctx, stop)
	err := app.Run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(ExitCode(err))
}

// Run runs one command line (without the program name), writing to stdout
// and stderr; it reads ONCELER_* variables from the process environment. An
// error has already been written to stderr, with the program's name.
func (app App) Run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	a := newApp(app, stdout, stderr, os.Getenv)
	err := a.run(ctx, args)
	if err != nil {
		var u *usageError
		if errors.As(err, &u) {
			u.prog = a.prog
		}
		fmt.Fprintln(stderr, a.prog+":", err)
	}
	return err
}

// ExitCode is the exit status for the error Run returned: 0 for nil, 2 for a
// usage error, 1 otherwise.
func ExitCode(err error) int {
	var u *usageError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &u):
		return 2
	default:
		return 1
	}
}

func newApp(user App, stdout, stderr io.Writer, getenv func(string) string) *app {
	prog := user.Name
	if prog == "" {
		prog = filepath.Base(os.Args[0])
	}
	return &app{stdout: stdout, stderr: stderr, getenv: getenv, prog: prog, user: user}
}

// progRef is the program's name where a text refers to it as a command
// ("'onceler migrate'", "Usage: onceler worker", "onceler runs ...").
var progRef = regexp.MustCompile(`(^|[\s'"(])onceler( |$)`)

// named is s with the references to the onceler command given the
// program's own name: the help texts are written for the onceler binary.
// Only texts of this package go through it, never an error, which may carry
// a database's or a broker's words (a schema named onceler).
func (a *app) named(s string) string {
	if a.prog == "onceler" {
		return s
	}
	return progRef.ReplaceAllString(s, "${1}"+strings.ReplaceAll(a.prog, "$", "$$")+"${2}")
}
