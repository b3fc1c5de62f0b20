package cmd

import (
	"context"
	"runtime"
	"runtime/debug"
	"strings"
	"testing"
)

// A duration without a unit, on the command line or in the environment,
// says what a duration looks like.
func TestDurationWithoutUnitSaysWhatIsExpected(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		args []string
		env  map[string]string
		want string
	}{
		{[]string{"worker", "--migrate", "--lease", "5"}, nil, `invalid value "5" for --lease: a duration needs a unit: 5s, 5m or 5h`},
		{[]string{"worker", "--migrate"}, map[string]string{"ONCELER_LEASE": "5"}, `invalid ONCELER_LEASE="5": a duration needs a unit: 5s, 5m or 5h`},
		{[]string{"worker", "--migrate", "--grace", "soon"}, nil, `invalid value "soon" for --grace: not a duration: use a number and a unit, such as 5s, 2m or 1h30m`},
	} {
		r := runBin(t, c.env, c.args...)
		line := oneLineError(t, r, 2)
		if !strings.Contains(line, c.want) || strings.Contains(line, "parse error") {
			t.Errorf("%v %v: %q, want it to contain %q", c.args, c.env, line, c.want)
		}
	}
}

// An unknown flag names the nearest known one when it looks like a typo,
// and nothing when nothing is near.
func TestUnknownFlagSuggestsTheNearest(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"worker", "--concurency", "3"}, "unknown flag --concurency; did you mean --concurrency? (run 'onceler worker --help')"},
		{[]string{"purge", "--dryrun"}, "unknown flag --dryrun; did you mean --dry-run?"},
		{[]string{"quarantine", "list", "--queu", "x"}, "unknown flag --queu; did you mean --queue?"},
		{[]string{"worker", "--bogus"}, "unknown flag --bogus (run 'onceler worker --help')"},
	} {
		r := runBin(t, nil, c.args...)
		if line := oneLineError(t, r, 2); !strings.Contains(line, c.want) {
			t.Errorf("%v: %q, want it to contain %q", c.args, line, c.want)
		}
	}
}

// Switches that decide what is destroyed are never read from the
// environment: ONCELER_ALL=1 does not make 'quarantine drop' drop every
// message, ONCELER_OLDER_THAN does not make 'purge' delete; each says what
// it needs instead. A safe switch (--dry-run) still is.
// Where a regression would reach, were the switch taken: nothing answers.
const (
	nowhereBroker = "amqp://guest:guest@127.0.0.1:1//"
	nowhereDB     = "postgres://root@127.0.0.1:1/root?connect_timeout=2"
)

func TestDestructiveSwitchesIgnoreTheEnvironment(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		args []string
		env  map[string]string
		want string
	}{
		{[]string{"quarantine", "drop"}, map[string]string{"ONCELER_ALL": "1", "ONCELER_BROKER_URL": nowhereBroker},
			"drop needs task ids or --all on the command line (ONCELER_ALL is ignored: --all is never taken from the environment)"},
		{[]string{"quarantine", "requeue"}, map[string]string{"ONCELER_ALL": "true", "ONCELER_BROKER_URL": nowhereBroker}, "requeue needs task ids or --all on the command line"},
		{[]string{"purge"}, map[string]string{"ONCELER_OLDER_THAN": "1s", "ONCELER_DATABASE_URL": nowhereDB},
			"--older-than is required on the command line, e.g. --older-than 30d (ONCELER_OLDER_THAN is ignored"},
		{[]string{"resolve", "t", "k"}, map[string]string{"ONCELER_COMPLETED": "1", "ONCELER_DATABASE_URL": nowhereDB}, "give exactly one of --completed and --retry"},
		{[]string{"resolve", "t", "k"}, map[string]string{"ONCELER_RETRY": "1", "ONCELER_DATABASE_URL": nowhereDB}, "give exactly one of --completed and --retry"},
	} {
		r := runBin(t, c.env, c.args...)
		if line := oneLineError(t, r, 2); !strings.Contains(line, c.want) {
			t.Errorf("%v %v: %q, want it to contain %q", c.args, c.env, line, c.want)
		}
	}
	for _, cmd := range []string{"quarantine", "purge", "resolve"} {
		r := runBin(t, nil, cmd, "--help")
		for _, name := range map[string][]string{"quarantine": {"all"}, "purge": {"older-than"}, "resolve": {"completed", "retry"}}[cmd] {
			if !strings.Contains(r.stdout, "(command line only)") || strings.Contains(r.stdout, envName(name)) {
				t.Errorf("%s --help does not say --%s is command line only:\n%s", cmd, name, r.stdout)
			}
		}
	}
	// The environment still sets the safe switches.
	fs := newFlagSet(purgeCommand())
	var dry bool
	fs.Bool(&dry, "dry-run", "")
	if err := fs.applyEnv(func(k string) string { return map[string]string{"ONCELER_DRY_RUN": "1"}[k] }); err != nil || !dry {
		t.Errorf("ONCELER_DRY_RUN=1: dry %v, err %v", dry, err)
	}
}

// quarantine takes --queues as the worker does, --queue as its alias, and
// ONCELER_QUEUES from the environment.
func TestQuarantineTakesQueues(t *testing.T) {
	t.Parallel()
	var got string
	c := quarantineCommand()
	c.setup = func(a *app, fs *flagSet) func(_ context.Context, args []string) error {
		fs.String(&got, "queues", "LIST", "celery", "")
		fs.Alias("queue", "queues")
		return func(context.Context, []string) error { return nil }
	}
	for _, tc := range []struct {
		args []string
		env  map[string]string
		want string
	}{
		{nil, nil, "celery"},
		{[]string{"--queues", "a,b"}, nil, "a,b"},
		{[]string{"--queue", "a"}, nil, "a"},
		{nil, map[string]string{"ONCELER_QUEUES": "x,y"}, "x,y"},
		{nil, map[string]string{"ONCELER_QUEUE": "x"}, "x"},
		{nil, map[string]string{"ONCELER_QUEUE": "x", "ONCELER_QUEUES": "y"}, "y"},
		{[]string{"--queue", "z"}, map[string]string{"ONCELER_QUEUES": "y"}, "z"},
	} {
		got = ""
		a := &app{stdout: &strings.Builder{}, stderr: &strings.Builder{}, getenv: func(k string) string { return tc.env[k] }}
		if err := a.runCommand(context.Background(), c, tc.args); err != nil || got != tc.want {
			t.Errorf("%v %v: queues %q (err %v), want %q", tc.args, tc.env, got, err, tc.want)
		}
	}
	r := runBin(t, nil, "quarantine", "list", "--queues", " , ")
	if line := oneLineError(t, r, 2); !strings.Contains(line, "--queues names no queue") {
		t.Errorf("empty --queues: %q", line)
	}
}

// 'onceler --version' and 'onceler version' print the module version and
// the build's Go version; the VCS revision when the build recorded one.
func TestVersion(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{"--version"}, {"version"}} {
		r := runBin(t, nil, args...)
		if r.code != 0 || !strings.HasPrefix(r.stdout, "onceler ") || !strings.HasSuffix(r.stdout, " "+runtime.Version()+"\n") || r.stderr != "" {
			t.Errorf("%v: code %d, stdout %q, stderr %q", args, r.code, r.stdout, r.stderr)
		}
	}
	bi := &debug.BuildInfo{GoVersion: "go1.99", Main: debug.Module{Version: "v1.2.3"}, Settings: []debug.BuildSetting{
		{Key: "vcs.revision", Value: "0123abc"}, {Key: "vcs.time", Value: "2025-01-02T03:04:05Z"}, {Key: "vcs.modified", Value: "true"}}}
	if got, want := formatVersion(bi), "onceler v1.2.3 revision 0123abc (modified) 2025-01-02T03:04:05Z go1.99"; got != want {
		t.Errorf("formatVersion: %q, want %q", got, want)
	}
}
