package cmd

import (
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/internal/testenv"
)

// writeSecret writes content to a file of the test's own and returns its
// path.
func writeSecret(t *testing.T, name, content string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// The -file flags: both a flag and its file, an unreadable file and an
// empty one are usage errors naming the path and never the content.
func TestSecretFileErrors(t *testing.T) {
	t.Parallel()
	const pw = "Zq8-secret-in-file"
	good := writeSecret(t, "db", "postgres://u:"+pw+"@127.0.0.1:1/x\n")
	missing := filepath.Join(t.TempDir(), "nope")
	empty := writeSecret(t, "empty", "\n")
	for _, tc := range []struct {
		env  map[string]string
		args []string
		want string
	}{
		{map[string]string{"ONCELER_DATABASE_URL_FILE": good, "ONCELER_DATABASE_URL": "postgres://x@127.0.0.1:1/x"}, []string{"records"},
			"give --database-url (ONCELER_DATABASE_URL) or --database-url-file (ONCELER_DATABASE_URL_FILE), not both"},
		{nil, []string{"records", "--database-url-file", good, "--database-url", "postgres://x@127.0.0.1:1/x"},
			"give --database-url (ONCELER_DATABASE_URL) or --database-url-file (ONCELER_DATABASE_URL_FILE), not both"},
		{map[string]string{"ONCELER_BROKER_URL_FILE": missing}, []string{"quarantine", "list", "--queue", "q"},
			"cannot read --broker-url-file " + missing + ": no such file or directory"},
		{nil, []string{"worker", "--result-backend-file", empty},
			"--result-backend-file " + empty + " is empty"},
		{nil, []string{"worker", "--sidekiq-file", missing},
			"cannot read --sidekiq-file " + missing},
	} {
		r := runIn(t, tc.env, tc.args...)
		if ExitCode(r.err) != 2 || !strings.Contains(r.err.Error(), tc.want) {
			t.Errorf("%v %v: %v, want a usage error saying %q", tc.env, tc.args, r.err, tc.want)
		}
	}
	// A bad URL in the file: one line, without the password.
	r := runBin(t, map[string]string{"ONCELER_DATABASE_URL_FILE": good}, "records")
	if line := oneLineError(t, r, 1); strings.Contains(line, pw) || !strings.Contains(line, "127.0.0.1:1") {
		t.Errorf("unreachable database from a file: %s", line)
	}
	bad := writeSecret(t, "bad", "postgres://u:"+pw+"@127.0.0.1:5432/x?sslmode=nonsense\n")
	r = runBin(t, map[string]string{"ONCELER_DATABASE_URL_FILE": bad}, "records")
	if line := oneLineError(t, r, 2); strings.Contains(line, pw) || !strings.Contains(line, "invalid --database-url") {
		t.Errorf("invalid URL from a file: %s", line)
	}
}

// rabbitUser adds a RabbitMQ user of the test's own with a password and
// every permission on vhost /, deleted when the test ends.
func rabbitUser(t *testing.T, password string) string {
	t.Helper()
	user := testenv.Name("u")
	ctl := func(args ...string) error {
		out, err := exec.Command("rabbitmqctl", args...).CombinedOutput()
		if err != nil {
			return &exec.Error{Name: strings.Join(args, " ") + ": " + strings.TrimSpace(string(out)), Err: err}
		}
		return nil
	}
	if err := ctl("add_user", user, password); err != nil {
		testenv.Unavailable(t, "rabbitmqctl: %v", err)
	}
	t.Cleanup(func() { _ = ctl("delete_user", user) })
	if err := ctl("set_permissions", "-p", "/", user, ".*", ".*", ".*"); err != nil {
		t.Fatal(err)
	}
	return user
}

// A worker given its database and broker URLs only as files
// (ONCELER_DATABASE_URL_FILE, ONCELER_BROKER_URL_FILE), each with a password,
// runs a task; at debug level no log line holds either password.
func TestWorkerReadsURLsFromFiles(t *testing.T) {
	t.Parallel()
	s := newStack(t)
	const dbPW, brokerPW = "db-Pw-7f3a9c", "mq-Pw-2b8e41"
	user := rabbitUser(t, brokerPW)
	bu, err := url.Parse(testenv.AMQPURL(t))
	if err != nil {
		t.Fatal(err)
	}
	bu.User = url.UserPassword(user, brokerPW)
	du, err := url.Parse(testenv.DatabaseURL(t))
	if err != nil {
		t.Fatal(err)
	}
	// The test server trusts local connections: the password is sent to
	// no one, but the worker holds it as it would a real one.
	du.User = url.UserPassword(du.User.Username(), dbPW)
	if r := runBin(t, s.env, "migrate"); r.code != 0 {
		t.Fatalf("migrate: %s", r.stderr)
	}
	env := s.with(map[string]string{
		"ONCELER_DATABASE_URL":      "",
		"ONCELER_BROKER_URL":        "",
		"ONCELER_DATABASE_URL_FILE": writeSecret(t, "db", du.String()+"\n"),
		"ONCELER_BROKER_URL_FILE":   writeSecret(t, "broker", bu.String()+"\r\n"),
		"ONCELER_LOG_LEVEL":         "debug",
	})
	w := start(t, "worker", env, binary, "worker")
	w.waitLog("consuming", 60*time.Second)
	_, replies := s.sendTasks(t, 60*time.Second, call{demo.TaskAdd, []any{20, 22}}).replies(90 * time.Second)
	if len(replies) != 1 || replies[0].OK != float64(42) {
		t.Fatalf("replies %+v", replies)
	}
	w.stop()
	logs := w.stderr.String()
	if !strings.Contains(logs, user) {
		t.Errorf("the log does not name the broker user %s (did the worker use the file?):\n%s", user, logs)
	}
	for _, pw := range []string{dbPW, brokerPW} {
		if strings.Contains(logs, pw) {
			t.Errorf("the log holds the password %q:\n%s", pw, logs)
		}
	}
}
