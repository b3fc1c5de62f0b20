package cmd

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/tasks"
)

// binary is the onceler command built once for the tests that run it as a
// process (with -race when the tests have it); buildDir holds it, and the
// other binaries the tests build.
var binary, buildDir string

func TestMain(m *testing.M) {
	os.Exit(testenv.Main(m, func(dir string) error {
		buildDir = dir
		binary = filepath.Join(dir, "onceler")
		args := []string{"build", "-o", binary}
		if raceEnabled {
			args = append(args, "-race")
		}
		if out, err := exec.Command("go", append(args, "./onceler")...).CombinedOutput(); err != nil {
			return fmt.Errorf("build onceler: %w\n%s", err, out)
		}
		return nil
	}))
}

// demoApp is the onceler binary's App (cmd/onceler), for the tests that run
// commands in-process.
var demoApp = App{
	Name: "onceler",
	Register: func(_ context.Context, reg *tasks.Registry, env Env) error {
		return demo.Register(reg, env.Pool, demo.WithLogger(env.Logger))
	},
	Migrate: demo.Migrate,
}

// result is what a command run produced.
type result struct {
	stdout, stderr string
	err            error
	code           int // exit status, for process runs
}

// runIn runs the command in-process with env as its whole environment.
func runIn(t *testing.T, env map[string]string, args ...string) result {
	t.Helper()
	var out, errOut bytes.Buffer
	a := newApp(demoApp, &out, &errOut, func(k string) string { return env[k] })
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	err := a.run(ctx, args)
	return result{stdout: out.String(), stderr: errOut.String(), err: err}
}

// runBin runs the built binary with env added to a clean environment.
func runBin(t *testing.T, env map[string]string, args ...string) result {
	t.Helper()
	return runProg(t, binary, env, args...)
}

// runProg runs the program at path with env added to a clean environment.
func runProg(t *testing.T, path string, env map[string]string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, path, args...)
	cmd.Env = processEnv(env)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	r := result{stdout: out.String(), stderr: errOut.String(), err: err}
	if cmd.ProcessState != nil {
		r.code = cmd.ProcessState.ExitCode()
	}
	return r
}

// processEnv is a minimal environment plus env: no ONCELER_* or PG* leaks in
// from the test's own environment.
func processEnv(env map[string]string) []string {
	out := []string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME")}
	for k, v := range env {
		out = append(out, k+"="+v)
	}
	return out
}

// oneLineError checks a failed process run: the given exit code and exactly
// one line on stderr, without a Go stack trace.
func oneLineError(t *testing.T, r result, code int) string {
	t.Helper()
	if r.code != code {
		t.Fatalf("exit code %d, want %d; stderr:\n%s", r.code, code, r.stderr)
	}
	lines := strings.Split(strings.TrimRight(r.stderr, "\n"), "\n")
	if len(lines) != 1 || lines[0] == "" {
		t.Fatalf("stderr has %d lines, want one:\n%s", len(lines), r.stderr)
	}
	if strings.Contains(r.stderr, "goroutine ") || strings.Contains(r.stderr, "panic") {
		t.Fatalf("stderr has a stack trace:\n%s", r.stderr)
	}
	return lines[0]
}
