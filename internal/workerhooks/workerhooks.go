// Package workerhooks holds the worker settings that are no part of
// package tasks' API: crash injection, for crash tests and the replay
// suite, and running without the idempotency record, for the --no-record
// demonstration. The onceler command (package cmd, and so every binary
// made with cmd.Main) sets them from ONCELER_CRASH_AT, ONCELER_CRASH_TASK
// and --no-record; the project's tests set them directly.
//
// # Crash injection
//
// Crash makes the process SIGKILL itself the first time a task reaches
// after_claim, after_effect or before_ack (or chord_joined), for testing
// recovery. A task without a record (pure, or any task under NoRecord)
// reaches after_claim just before it runs and after_effect just after it
// returns (a same-database task under NoRecord: before its own transaction
// commits).
//
// # Without the record
//
// NoRecord runs every task without the record, to show what the record
// prevents: every delivery runs, duplicates repeat their effects. A
// same-database task then runs its RunTx in a transaction of its own on
// tasks.Config.Pool, committed when it succeeds and rolled back when it
// fails.
package workerhooks

import "fmt"

// Crash points for Crash.At.
const (
	// AfterClaim: the claim is committed (same-database: taken in the
	// open transaction), the task has not run. Tasks without a record (pure,
	// or any task under NoRecord): just before the task runs.
	AfterClaim = "after_claim"
	// AfterEffect: same-database, after the task's effect and before the
	// commit; outside, after Run returned and before Complete. Tasks without
	// a record: after the task returned (NoRecord same-database: before its
	// own transaction commits), before the reply.
	AfterEffect = "after_effect"
	// BeforeAck: after completion and the result publish, before the ack.
	BeforeAck = "before_ack"
	// ChordJoined: a chord header part completed its chord (Redis result
	// backend), before the chord's body is published.
	ChordJoined = "chord_joined"
)

// Crash makes the process kill itself with SIGKILL the first time a task
// named Task (any task when empty) reaches the point At. The zero value
// injects nothing.
type Crash struct {
	At   string
	Task string
}

// Validate refuses an unknown crash point.
func (c Crash) Validate() error {
	switch c.At {
	case "", AfterClaim, AfterEffect, BeforeAck, ChordJoined:
		return nil
	}
	return fmt.Errorf("unknown crash point %q (want %s, %s, %s or %s)", c.At, AfterClaim, AfterEffect, BeforeAck, ChordJoined)
}

// CrashFromEnv reads ONCELER_CRASH_AT and ONCELER_CRASH_TASK through
// getenv (os.Getenv, or a command's own environment).
func CrashFromEnv(getenv func(string) string) Crash {
	return Crash{At: getenv("ONCELER_CRASH_AT"), Task: getenv("ONCELER_CRASH_TASK")}
}

// Hooks are a worker's settings that package tasks does not export.
type Hooks struct {
	// NoRecord runs every task without the record, as if pure: duplicates
	// run again. A same-database task then runs its RunTx in a transaction
	// of its own on tasks.Config.Pool, which is then required.
	NoRecord bool
	// Crash injects a process crash at a pipeline point.
	Crash Crash
}

// set puts Hooks into a *tasks.Config: a func(*tasks.Config, Hooks),
// which package tasks installs (this package cannot name the type: tasks
// imports it).
var set any

// Install is called by package tasks, once, when it is initialised, with
// the function that puts Hooks into a *tasks.Config.
func Install[C any](f func(*C, Hooks)) { set = f }

// Set puts h into cfg, a *tasks.Config; tasks.NewWorker applies them.
func Set[C any](cfg *C, h Hooks) {
	f, ok := set.(func(*C, Hooks))
	if !ok {
		panic(fmt.Sprintf("workerhooks: Set takes a *tasks.Config, not %T", cfg))
	}
	f(cfg, h)
}
