package cmd

import (
	"errors"
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
		"amqp://guest:secretpw@127.0.0.1:5672//;amqp://guest:secretpw@127.0.0.2//",
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
