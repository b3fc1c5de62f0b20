package integration

import (
	"bytes"
	"context"
	"net/url"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// brokerUser is a vhost of the test's own on the shared RabbitMQ, with
// guest given every permission in it (the suite's own connection) and a
// user of the test's own, given only what grant sets: the worker's. Both
// are deleted when the test ends.
type brokerUser struct {
	vhost, user string
	// suiteURL is guest's URL of the vhost; workerURL the user's.
	suiteURL, workerURL string
}

// newBrokerUser makes the vhost and the user with rabbitmqctl, which
// must act on the broker the tests use (a local one).
func newBrokerUser(t *testing.T) *brokerUser {
	t.Helper()
	base, err := url.Parse(testkit.Rabbit.URL(t))
	if err != nil {
		t.Fatalf("broker URL: %v", err)
	}
	if h := base.Hostname(); h != "127.0.0.1" && h != "localhost" {
		testenv.Unavailable(t, "the broker at %s is not local: rabbitmqctl cannot give its users permissions", h)
	}
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		testenv.Unavailable(t, "rabbitmqctl: %v", err)
	}
	b := &brokerUser{vhost: testkit.Name("sec"), user: testkit.Name("w")}
	password := testkit.NewID()
	rabbitmqctl(t, "add_vhost", b.vhost)
	t.Cleanup(func() { _, _ = runCtl([]string{"rabbitmqctl"}, "delete_vhost", b.vhost) })
	rabbitmqctl(t, "add_user", b.user, password)
	t.Cleanup(func() { _, _ = runCtl([]string{"rabbitmqctl"}, "delete_user", b.user) })
	rabbitmqctl(t, "set_permissions", "-p", b.vhost, base.User.Username(), ".*", ".*", ".*")
	u := *base
	u.Path = "/" + b.vhost
	b.suiteURL = u.String()
	u.User = url.UserPassword(b.user, password)
	b.workerURL = u.String()
	return b
}

func rabbitmqctl(t *testing.T, args ...string) {
	t.Helper()
	if out, err := runCtl([]string{"rabbitmqctl"}, args...); err != nil {
		testenv.Unavailable(t, "%v\n%s", err, out)
	}
}

// grant sets the user's configure, write and read permissions.
func (b *brokerUser) grant(t *testing.T, p [3]string) {
	t.Helper()
	if out, err := runCtl([]string{"rabbitmqctl"}, "set_permissions", "-p", b.vhost, b.user, p[0], p[1], p[2]); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
}

// printed runs 'onceler permissions' with args and the user's URL, and
// returns the configure, write and read expressions of the
// set_permissions line it prints, after checking its other lines.
func (b *brokerUser) printed(t *testing.T, args ...string) [3]string {
	t.Helper()
	cmd := exec.Command(oncelerBin, append([]string{"permissions", "--broker-url", b.workerURL}, args...)...)
	cmd.Env = []string{"PATH=/usr/bin:/bin"}
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	if err := cmd.Run(); err != nil {
		t.Fatalf("onceler permissions: %v\n%s", err, errOut.String())
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	want := []string{"rabbitmqctl add_vhost '" + b.vhost + "'", "rabbitmqctl add_user '" + b.user + "' 'PASSWORD'"}
	if len(lines) != 3 || lines[0] != want[0] || lines[1] != want[1] {
		t.Fatalf("onceler permissions printed:\n%s\nwant first %q", out.String(), want)
	}
	f := shellWords(t, lines[2])
	if len(f) != 8 || strings.Join(f[:5], " ") != "rabbitmqctl set_permissions -p "+b.vhost+" "+b.user {
		t.Fatalf("set_permissions line %q", lines[2])
	}
	if strings.Contains(out.String(), strings.TrimPrefix(b.workerURL, "amqp://")) {
		t.Fatalf("onceler permissions printed the password:\n%s", out.String())
	}
	return [3]string{f[5], f[6], f[7]}
}

// shellWords splits a line of words, each plain or in single quotes (a
// quote inside written as quote, backslash, quote, quote), as a POSIX
// shell does.
func shellWords(t *testing.T, line string) []string {
	t.Helper()
	var words []string
	var w strings.Builder
	in, quoted := false, false
	for i := 0; i < len(line); i++ {
		c := line[i]
		switch {
		case c == '\'':
			in, quoted = !in, true
		case c == '\\' && !in && i+1 < len(line):
			i++
			w.WriteByte(line[i])
		case c == ' ' && !in:
			if quoted || w.Len() > 0 {
				words = append(words, w.String())
			}
			w.Reset()
			quoted = false
		default:
			w.WriteByte(c)
		}
	}
	if in {
		t.Fatalf("unterminated quote in %q", line)
	}
	if quoted || w.Len() > 0 {
		words = append(words, w.String())
	}
	return words
}

// TestReplayLeastPrivilege runs the replay suite's "three times" and
// "killed after the claim" scenarios with workers whose RabbitMQ user has
// only the permissions 'onceler permissions' prints for them (the
// scenario's queue and node names are random: the printed expressions
// get patterns for them) and whose PostgreSQL role has only what
// 'onceler migrate --grant-to' grants: the same outcomes as with guest
// and a superuser.
func TestReplayLeastPrivilege(t *testing.T) {
	t.Parallel()
	b := newBrokerUser(t)
	roleURL, prepare := workerRole(t)
	// The suite names its queues replay_<12 hex digits> and its workers
	// replay<n>_<12 hex digits> (testkit.Name).
	p := b.printed(t, "--queues", "replay_QUEUEID", "--hostname", "replayNODE")
	for i := range p {
		p[i] = strings.ReplaceAll(p[i], "QUEUEID", "[0-9a-f]{12}")
		p[i] = strings.ReplaceAll(p[i], "NODE", "[0-9]+_[0-9a-f]{12}")
	}
	b.grant(t, p)
	for _, tg := range demoTargets() {
		if tg.Task != demo.TaskCredit && tg.Task != demo.TaskCharge {
			continue
		}
		t.Run(tg.Task, func(t *testing.T) {
			tg.Scenarios = []replay.Scenario{replay.ScenarioRepeated, replay.ScenarioCrashAfterClaim}
			tg.AMQPURL, tg.WorkerBrokerURL = b.suiteURL, b.workerURL
			tg.Command = []string{"worker"} // the role may not migrate
			tg.WorkerDatabaseURL, tg.Prepare = roleURL, prepare
			tg.Env = append(tg.Env, "ONCELER_EVENTS=true")
			replay.Run(t, tg)
		})
	}
}

// TestMissingBrokerPermissionFailsAtStart takes away one permission at a
// time from those 'onceler permissions' prints: each whole one, and each
// part that only the remote control and events use (which would otherwise
// fail in their reconnect loop, after the start). The worker exits with
// status 1 at start, its last line naming the permission, the resource and
// what it was for.
func TestMissingBrokerPermissionFailsAtStart(t *testing.T) {
	t.Parallel()
	b := newBrokerUser(t)
	pool := testenv.Pool(t)
	queue, node := testkit.Name("q"), testkit.Name("n")
	full := b.printed(t, "--queues", queue, "--hostname", node+"@%h")
	without := func(expr, alt string) string {
		out := strings.Replace(expr, "|"+alt, "", 1)
		if out == expr {
			t.Fatalf("%q has no alternative %q", expr, alt)
		}
		return out
	}
	mb := node + `@.+\.celery\.pidbox`
	cases := []struct {
		name string
		p    [3]string
		want string // in the last line, after `RabbitMQ refused user "<user>" `
	}{
		{"configure", [3]string{"^$", full[1], full[2]}, "configure access to exchange '" + queue + "'"},
		{"write", [3]string{full[0], "^$", full[2]}, "write access to queue '" + queue + "'"},
		{"read", [3]string{full[0], full[1], "^$"}, "read access to exchange '" + queue + "'"},
		{"configure quarantine", [3]string{strings.Replace(full[0], `(\.quarantine)?`, "", 1), full[1], full[2]},
			"configure access to queue '" + queue + ".quarantine'"},
		{"write default exchange", [3]string{full[0], without(full[1], `amq\.default`), full[2]},
			"write access to exchange 'amq.default'"},
		{"configure mailbox", [3]string{without(full[0], mb), full[1], full[2]}, "configure access to queue '" + node + "@"},
		{"write events", [3]string{full[0], without(full[1], `celeryev`), full[2]}, "write access to exchange 'celeryev'"},
		{"write control replies", [3]string{full[0], without(full[1], `reply\.celery\.pidbox`), full[2]},
			"write access to exchange 'reply.celery.pidbox'"},
		{"read mailbox", [3]string{full[0], full[1], without(full[2], mb)}, "read access to queue '" + node + "@"},
		{"read pidbox exchange", [3]string{full[0], full[1], without(full[2], `celery\.pidbox`)}, "read access to exchange 'celery.pidbox'"},
	}
	for _, c := range cases {
		b.grant(t, c.p)
		schema := testenv.Schema(t, pool)
		ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
		cmd := exec.CommandContext(ctx, oncelerBin, "worker", "--migrate", "--queues", queue, "--hostname", node+"@%h", "--log-level", "error")
		cmd.Env = []string{"PATH=/usr/bin:/bin", "ONCELER_BROKER_URL=" + b.workerURL, "ONCELER_DATABASE_URL=" + testenv.DatabaseURL(t),
			"ONCELER_SCHEMA=" + schema}
		var errOut bytes.Buffer
		cmd.Stdout, cmd.Stderr = &errOut, &errOut
		start := time.Now()
		err := cmd.Run()
		cancel()
		took := time.Since(start)
		lines := strings.Split(strings.TrimSpace(errOut.String()), "\n")
		last := lines[len(lines)-1]
		code := -1
		if cmd.ProcessState != nil {
			code = cmd.ProcessState.ExitCode()
		}
		prefix := `onceler: RabbitMQ refused user "` + b.user + `" ` + c.want
		if code != 1 || !strings.HasPrefix(last, prefix) || !strings.HasSuffix(last, "; see docs/security.md") {
			t.Errorf("%s: exit %d (%v) after %s, last line:\n%s\nwant exit 1 and a line starting %q; output:\n%s", c.name, code, err, took, last, prefix, errOut.String())
			continue
		}
		t.Logf("%s: exit 1 after %s: %s", c.name, took.Round(time.Millisecond), last)
	}
	// With every permission printed, it starts, consumes and answers
	// Celery's remote control.
	b.grant(t, full)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cmd := exec.CommandContext(ctx, oncelerBin, "worker", "--migrate", "--queues", queue, "--hostname", node+"@%h", "--events")
	cmd.Env = []string{"PATH=/usr/bin:/bin", "ONCELER_BROKER_URL=" + b.workerURL, "ONCELER_DATABASE_URL=" + testenv.DatabaseURL(t),
		"ONCELER_SCHEMA=" + testenv.Schema(t, pool)}
	log := &lockedBuffer{}
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	defer func() { cancel(); <-done }()
	py := testenv.Python(t)
	deadline := time.Now().Add(60 * time.Second)
	for {
		out, err := exec.Command(py, "-c", pingPy, b.suiteURL, node).CombinedOutput()
		if err == nil && strings.Contains(string(out), "pong") {
			break
		}
		select {
		case <-done:
			t.Fatalf("the worker with every permission printed exited:\n%s", log.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("no pong from %s: %v %s\nworker log:\n%s", node, err, out, log.String())
		}
		time.Sleep(500 * time.Millisecond)
	}
	if strings.Contains(log.String(), "ACCESS_REFUSED") {
		t.Fatalf("the worker met a refusal:\n%s", log.String())
	}
}

// lockedBuffer is a bytes.Buffer a process writes while the test reads it.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// pingPy pings the node argv[2] through the broker argv[1], as 'celery
// inspect ping' does, and prints the answer.
const pingPy = `
import sys
from celery import Celery
app = Celery("ping", broker=sys.argv[1])
print(app.control.inspect(destination=[sys.argv[2] + "@" + __import__("socket").gethostname()], timeout=3).ping())
`
