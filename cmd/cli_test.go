package cmd

import (
	"errors"
	"runtime"
	"runtime/debug"
	"strings"
	"testing"
	"time"

	"github.com/onceler/onceler/internal/testenv"
)

func TestUsageErrorsAreOneLineWithExitStatus2(t *testing.T) {
	t.Parallel()
	cases := []struct {
		args []string
		env  map[string]string
		want string
	}{
		{nil, nil, "no command given"},
		{[]string{"frobnicate"}, nil, `unknown command "frobnicate"`},
		{[]string{"worker", "--bogus"}, nil, "worker: unknown flag --bogus (run 'onceler worker --help')"},
		{[]string{"worker", "--concurrency", "many"}, nil, `invalid value "many" for --concurrency`},
		{[]string{"worker", "--lease"}, nil, "--lease needs a value"},
		{[]string{"worker", "--migrate", "--log-level", "loud"}, nil, `invalid --log-level "loud"`},
		{[]string{"worker", "--migrate", "--log-format", "xml"}, nil, `invalid --log-format "xml"`},
		{[]string{"worker", "--migrate"}, map[string]string{"ONCELER_LEASE": "soon"}, `invalid ONCELER_LEASE="soon"`},
		{[]string{"worker", "--migrate"}, map[string]string{"ONCELER_CRASH_AT": "lunch"}, `invalid ONCELER_CRASH_AT="lunch"`},
		{[]string{"worker", "--migrate", "--group-tx", "33"}, nil, "--group-tx must be between 0 and 32"},
		{[]string{"worker", "--migrate", "--flushers", "17"}, nil, "--flushers must be between 0 and 16"},
		{[]string{"worker", "--migrate"}, map[string]string{"ONCELER_FLUSHERS": "-1"}, "--flushers must be between 0 and 16"},
		{[]string{"worker", "--migrate", "--queues", " , "}, nil, "--queues names no queue"},
		{[]string{"worker", "--migrate", "--queue-arg", "x-max-priority"}, nil, `invalid --queue-arg "x-max-priority": use ARG=VALUE or QUEUE:ARG=VALUE`},
		{[]string{"worker", "--migrate", "--queue-arg", "other:x-max-priority=10"}, nil, `queue "other" is not among --queues`},
		{[]string{"worker", "--migrate", "--quorum"}, map[string]string{"ONCELER_QUEUE_ARG": "x-queue-type=classic"}, "--quorum and --queue-arg x-queue-type=classic disagree for queue celery"},
		{[]string{"records", "--schema", "bad-name;"}, nil, `invalid --schema "bad-name;"`},
		{[]string{"records", "--database-url", "postgres://a:b@host:notaport/x"}, nil, "invalid --database-url"},
		{[]string{"repeats", "--since", "yesterday"}, nil, `invalid --since "yesterday"`},
		{[]string{"quarantine"}, nil, "want an action"},
		{[]string{"quarantine", "drop"}, nil, "drop needs task ids or --all"},
		{[]string{"quarantine", "shred"}, nil, `unknown action "shred"`},
		{[]string{"quarantine", "list", "--reason", "nonsense"}, nil, `unknown --reason "nonsense"`},
		{[]string{"worker", "--migrate", "--http-addr", "nonsense"}, nil, `invalid --http-addr "nonsense"`},
		{[]string{"purge", "--older-than", "213504d"}, nil, `invalid --older-than "213504d": at most 36500d`},
		{[]string{"worker", "--migrate", "--result-backend", "db+postgresql://app:secret@db/app"}, nil,
			"invalid --result-backend: tasks: result backend: Celery's SQLAlchemy backend (db+postgresql://) stores results as pickles, which onceler never writes (use rpc://, redis://, rediss://, redis+socket://, django-db+postgresql://)"},
		{[]string{"worker", "--migrate"}, map[string]string{"ONCELER_RESULT_BACKEND": "mongodb://app:secret@m/r"}, `unsupported scheme "mongodb" (use rpc://, redis://, rediss://, redis+socket://, django-db+postgresql://)`},
		{[]string{"worker", "--migrate", "--result-backend", "redis://:secret@cache/zero"}, nil, `Redis database "zero" is not a number`},
		{[]string{"worker", "--migrate", "--result-expires", "-1s"}, nil, "--result-expires must not be negative"},
	}
	for _, c := range cases {
		r := runBin(t, c.env, c.args...)
		line := oneLineError(t, r, 2)
		if !strings.HasPrefix(line, "onceler: ") || !strings.Contains(line, c.want) {
			t.Errorf("%v: stderr %q, want it to contain %q", c.args, line, c.want)
		}
		if strings.Contains(line, "secret") {
			t.Errorf("%v: stderr shows a password: %q", c.args, line)
		}
	}
}

func TestHelpGoesToStdoutWithExitStatus0(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{"help"}, {"--help"}, {"help", "purge"}, {"purge", "--help"}, {"worker", "-h"}} {
		r := runBin(t, nil, args...)
		if r.code != 0 || r.stderr != "" || !strings.Contains(r.stdout, "onceler") {
			t.Fatalf("%v: exit %d, stderr %q, stdout %q", args, r.code, r.stderr, r.stdout)
		}
	}
	r := runBin(t, nil, "purge", "--help")
	for _, want := range []string{"Usage: onceler purge [flags]", "--older-than DURATION", "--older-than DURATION\n        delete records last updated before now minus this, e.g. 720h or 30d\n        (required)\n        (command line only)", "--dry-run", "(env ONCELER_BATCH_SIZE, default 1000)"} {
		if !strings.Contains(r.stdout, want) {
			t.Fatalf("purge --help misses %q:\n%s", want, r.stdout)
		}
	}
}

func TestUnreachableDatabaseIsOneLineWithTheRedactedURL(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{"migrate"}, {"records"}, {"repeats"}, {"purge", "--older-than", "1d"}, {"resolve", "t", "k", "--completed"}, {"worker", "--migrate"}} {
		r := runBin(t, map[string]string{"ONCELER_DATABASE_URL": "postgres://app:secret@127.0.0.1:1/app"}, args...)
		line := oneLineError(t, r, 1)
		if !strings.Contains(line, "cannot reach PostgreSQL at postgres://app@127.0.0.1:1/app") ||
			!strings.Contains(line, "check --database-url (ONCELER_DATABASE_URL)") || strings.Contains(line, "secret") {
			t.Fatalf("%v: %q", args, line)
		}
	}
}

// A database URL listing several hosts (libpq's multi-host URL, chosen
// from by target_session_attrs) is accepted; when no host answers, the
// error names every host, without the password.
func TestUnreachableMultiHostDatabase(t *testing.T) {
	t.Parallel()
	for _, dsn := range []string{
		"postgres://app:secret@127.0.0.1:1,127.0.0.1:2/app?target_session_attrs=read-write",
		"postgres://app:secret@[::1]:1,127.0.0.1:2/app?target_session_attrs=read-write&sslmode=disable",
	} {
		r := runBin(t, map[string]string{"ONCELER_DATABASE_URL": dsn}, "migrate")
		line := oneLineError(t, r, 1)
		host := strings.Split(strings.Split(dsn, "@")[1], "/")[0]
		if !strings.Contains(line, "cannot reach PostgreSQL at postgres://app@"+host+"/app") || strings.Contains(line, "secret") {
			t.Errorf("%s: %q", dsn, line)
		}
	}
}

// A malformed URL is a usage error whose message never shows the password,
// whatever the flaw, and a broker URL that would be read without its host
// is refused rather than dialled as localhost.
func TestMalformedURLsHideTheirPassword(t *testing.T) {
	t.Parallel()
	for _, dsn := range []string{
		"postgres://postgres:secretpw@127.0.0.1:abc/test",
		"postgres://postgres:secret%zzpw@127.0.0.1:5432/test",
		"postgresql://postgres:secret pw@127.0.0.1:5432/test",
		"postgres://postgres:secretpw@[::1:5432/test",
		"postgres://127.0.0.1:5432/test?password=secretpw&sslmode=bogus",
		"postgres:secretpw@127.0.0.1/test",
		"host=127.0.0.1 port=abc user=postgres password = secretpw dbname=test",
		`host=127.0.0.1 port=abc user=postgres password='secret\'pw' dbname=test`,
	} {
		r := runBin(t, map[string]string{"ONCELER_DATABASE_URL": dsn}, "migrate")
		line := oneLineError(t, r, 2)
		if !strings.Contains(line, "invalid --database-url") || strings.Contains(line, "secret") {
			t.Errorf("%s: %q", dsn, line)
		}
	}
	for _, url := range []string{
		"amqp:guest:secretpw@127.0.0.1:5672//",
		"amqp:/guest:secretpw@127.0.0.1:5672//",
		"guest:secretpw@127.0.0.1",
		"amqp://guest:secretpw@127.0.0.1:5672//;amqp:guest:secretpw@127.0.0.2//", // the second of a list
	} {
		r := runBin(t, map[string]string{"ONCELER_BROKER_URL": url}, "quarantine", "list")
		line := oneLineError(t, r, 2)
		if !strings.Contains(line, "broker URL") || strings.Contains(line, "secret") {
			t.Errorf("%s: %q", url, line)
		}
	}
}

// A broker that answers but refuses the credentials or the vhost is
// reported as refusing, with its reason, at once: not as unreachable after
// the connect timeout.
func TestRefusingBrokerSaysWhy(t *testing.T) {
	testenv.AMQPURL(t)
	for url, want := range map[string]string{
		"amqp://guest:secretpw@127.0.0.1:5672//":          "username or password not allowed",
		"amqp://guest:guest@127.0.0.1:5672/onceler-no-vh": "vhost onceler-no-vh not found",
	} {
		start := time.Now()
		r := runBin(t, map[string]string{"ONCELER_BROKER_URL": url}, "quarantine", "list")
		line := oneLineError(t, r, 1)
		if !strings.Contains(line, "refused") || !strings.Contains(line, want) || strings.Contains(line, "secretpw") {
			t.Errorf("%s: %q", url, line)
		}
		if took := time.Since(start); took >= connectTimeout {
			t.Errorf("%s: answered after %s, the whole connect timeout", url, took)
		}
	}
}

func TestUnreachableBrokerIsOneLineWithTheRedactedURL(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t)
	schema := testenv.Schema(t, pool)
	env := map[string]string{
		"ONCELER_DATABASE_URL": testenv.DatabaseURL(t),
		"ONCELER_SCHEMA":       schema,
		"ONCELER_BROKER_URL":   "amqp://guest:secret@127.0.0.1:1//",
		"ONCELER_QUEUES":       testenv.Name("q"),
	}
	for _, args := range [][]string{{"worker", "--migrate"}, {"quarantine", "list"}} {
		r := runBin(t, env, args...)
		line := oneLineError(t, r, 1)
		if !strings.Contains(line, "cannot reach RabbitMQ at amqp://guest:xxxxx@127.0.0.1:1//") ||
			!strings.Contains(line, "check --broker-url (ONCELER_BROKER_URL)") || strings.Contains(line, "secret") {
			t.Fatalf("%v: %q", args, line)
		}
	}
}

// A broker URL list (Celery's ';'): a command whose first URL is down
// connects to the next; when all are down, the error names them all,
// redacted.
func TestBrokerURLListFailsOver(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t)
	schema := testenv.Schema(t, pool)
	env := map[string]string{
		"ONCELER_DATABASE_URL": testenv.DatabaseURL(t),
		"ONCELER_SCHEMA":       schema,
		"ONCELER_BROKER_URL":   "amqp://guest:secret@127.0.0.1:1// ; " + testenv.AMQPURL(t),
		"ONCELER_QUEUES":       testenv.Name("q"),
	}
	if r := runBin(t, env, "quarantine", "list"); r.code != 0 {
		t.Fatalf("quarantine list over the second URL: exit %d\n%s", r.code, r.stderr)
	}
	env["ONCELER_BROKER_URL"] = "amqp://guest:secret@127.0.0.1:1//;amqp://guest:secret@127.0.0.1:2//"
	line := oneLineError(t, runBin(t, env, "quarantine", "list"), 1)
	if !strings.Contains(line, "cannot reach RabbitMQ at amqp://guest:xxxxx@127.0.0.1:1//;amqp://guest:xxxxx@127.0.0.1:2//") ||
		strings.Contains(line, "secret") {
		t.Fatalf("all URLs down: %q", line)
	}
}

func TestEnvironmentSetsDefaultsAndFlagsWin(t *testing.T) {
	t.Parallel()
	c := lookupCommand("repeats")
	a := &app{getenv: func(k string) string {
		return map[string]string{"ONCELER_SINCE": "2h", "ONCELER_SCHEMA": "from_env", "ONCELER_JSON": "true"}[k]
	}}
	fs := newFlagSet(c)
	c.setup(a, fs)
	if err := fs.applyEnv(a.getenv); err != nil {
		t.Fatal(err)
	}
	if _, err := fs.parse([]string{"--schema", "from_flag"}); err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, n := range []string{"since", "schema", "json"} {
		got[n] = fs.fs.Lookup(n).Value.String()
	}
	if got["since"] != "2h" || got["schema"] != "from_flag" || got["json"] != "true" {
		t.Fatalf("flag values %v", got)
	}
}

func TestFlagsMayFollowPositionalArguments(t *testing.T) {
	t.Parallel()
	c := lookupCommand("resolve")
	fs := newFlagSet(c)
	c.setup(&app{getenv: func(string) string { return "" }}, fs)
	pos, err := fs.parse([]string{"demo.email.send", "--completed", "msg-1", "--result", "1", "--", "--x"})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(pos, " ") != "demo.email.send msg-1 --x" || fs.fs.Lookup("completed").Value.String() != "true" {
		t.Fatalf("positional %q", pos)
	}
	var u *usageError
	if _, err := fs.parse([]string{"a", "--nope"}); !errors.As(err, &u) {
		t.Fatalf("unknown flag after an argument: %v", err)
	}
}

func TestParseSince(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{"90m": "1h30m0s", "7d": "168h0m0s", "1d12h": "36h0m0s", "36500d": "876000h0m0s"} {
		d, err := parseSince("x", "--since", in)
		if err != nil || d.String() != want {
			t.Errorf("%s: %v %v, want %s", in, d, err, want)
		}
	}
	for _, in := range []string{"", "0s", "-5m", "d", "3x", "213504d", "300000d", "36500d2562047h"} {
		if _, err := parseSince("x", "--since", in); err == nil {
			t.Errorf("%q: no error", in)
		}
	}
}

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
