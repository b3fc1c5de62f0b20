package integration

import (
	"cmp"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceler/onceler/internal/testenv"
)

// privateRabbit is a RabbitMQ node of the test's own (its own node name,
// ports and data directory), so that the test may close all its
// connections and stop and start it without disturbing anyone else.
type privateRabbit struct {
	node, dir, url string
	port, dist     int
	cmd            *exec.Cmd
	done           chan struct{}
}

// rabbitOptions are the settings of a private node beyond the defaults.
type rabbitOptions struct {
	// conf holds extra rabbitmq.conf lines (e.g. "consumer_timeout = 5000\n").
	conf string
	// advanced is an advanced.config (Erlang terms) for settings
	// rabbitmq.conf has no key for; empty: none.
	advanced string
}

// startRabbit starts a private RabbitMQ node, stopped and removed when the
// test ends. It needs rabbitmq-server and root (to run it as the rabbitmq
// user, who owns the Erlang cookie).
func startRabbit(t *testing.T) *privateRabbit {
	t.Helper()
	r := newRabbit(t, rabbitOptions{})
	r.await(t)
	return r
}

// newRabbit starts a private RabbitMQ node without waiting for it (see
// await), stopped and removed when the test ends. Every node runs as the
// rabbitmq user with its home /var/lib/rabbitmq, so all share that user's
// Erlang cookie: they may form a cluster (see startRabbitCluster).
func newRabbit(t *testing.T, o rabbitOptions) *privateRabbit {
	t.Helper()
	const server = "/usr/lib/rabbitmq/bin/rabbitmq-server"
	if _, err := os.Stat(server); err != nil || os.Geteuid() != 0 {
		if testenv.Required() {
			t.Fatalf("a private RabbitMQ node needs %s and root", server)
		}
		t.Skip("no rabbitmq-server, or not root")
	}
	dir, err := os.MkdirTemp("", "onceler-rabbit")
	if err != nil {
		t.Fatal(err)
	}
	port, dist := freePort(t), freePort(t)
	r := &privateRabbit{node: testenv.Name("onceler_fault") + "@localhost", dir: dir, port: port, dist: dist,
		url: fmt.Sprintf("amqp://guest:guest@127.0.0.1:%d/", port)}
	files := map[string]string{
		"rabbitmq.conf":   fmt.Sprintf("listeners.tcp.1 = 127.0.0.1:%d\nloopback_users = none\n%s", port, o.conf),
		"advanced.config": cmp.Or(o.advanced, "[].") + "\n",
		"plugins":         "[].\n",
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if out, err := exec.Command("chown", "-R", "rabbitmq", dir).CombinedOutput(); err != nil {
		t.Fatalf("chown: %v\n%s", err, out)
	}
	r.launch(t)
	t.Cleanup(func() {
		_, _ = r.ctl("stop")
		select {
		case <-r.done:
		case <-time.After(30 * time.Second):
			_ = r.cmd.Process.Kill()
			<-r.done
		}
		_ = os.RemoveAll(dir)
	})
	return r
}

// launch starts the node's server process (again, after kill).
func (r *privateRabbit) launch(t *testing.T) {
	t.Helper()
	log, err := os.OpenFile(filepath.Join(r.dir, "server.out"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close()
	cmd := exec.Command("runuser", "-u", "rabbitmq", "--", "env", "HOME=/var/lib/rabbitmq",
		"RABBITMQ_NODENAME="+r.node, fmt.Sprintf("RABBITMQ_DIST_PORT=%d", r.dist),
		"RABBITMQ_MNESIA_BASE="+filepath.Join(r.dir, "mnesia"), "RABBITMQ_LOG_BASE="+filepath.Join(r.dir, "log"),
		"RABBITMQ_ENABLED_PLUGINS_FILE="+filepath.Join(r.dir, "plugins"),
		"RABBITMQ_CONFIG_FILE="+filepath.Join(r.dir, "rabbitmq.conf"),
		"RABBITMQ_ADVANCED_CONFIG_FILE="+filepath.Join(r.dir, "advanced.config"),
		"RABBITMQ_PID_FILE="+r.pidFile(), "/usr/lib/rabbitmq/bin/rabbitmq-server")
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatalf("start rabbitmq-server: %v", err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(done)
	}()
	r.cmd, r.done = cmd, done
}

func (r *privateRabbit) pidFile() string { return filepath.Join(r.dir, "pid") }

// await waits until the node runs and answers AMQP.
func (r *privateRabbit) await(t *testing.T) {
	t.Helper()
	if out, err := r.ctl("wait", r.pidFile(), "--timeout", "120"); err != nil {
		b, _ := os.ReadFile(filepath.Join(r.dir, "server.out"))
		t.Fatalf("private RabbitMQ node %s did not start: %v\n%s\n%s", r.node, err, out, b)
	}
	r.waitAMQP(t)
}

// kill ends the node's Erlang VM with SIGKILL (no shutdown: as a crash or
// an OOM kill does) and waits for its server process to end; it returns the
// VM's OS pid.
func (r *privateRabbit) kill(t *testing.T) int {
	t.Helper()
	b, err := os.ReadFile(r.pidFile())
	if err != nil {
		t.Fatalf("pid file of %s: %v", r.node, err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 1 {
		t.Fatalf("pid file of %s: %q", r.node, b)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatalf("kill -9 %d (%s): %v", pid, r.node, err)
	}
	select {
	case <-r.done:
	case <-time.After(30 * time.Second):
		t.Fatalf("server process of %s still running 30 s after kill -9 of its VM (pid %d)", r.node, pid)
	}
	return pid
}

// ctl runs rabbitmqctl against the private node.
func (r *privateRabbit) ctl(args ...string) (string, error) {
	return runCtl([]string{"runuser", "-u", "rabbitmq", "--", "env", "HOME=/var/lib/rabbitmq", "rabbitmqctl", "-n", r.node}, args...)
}

// runCtl runs the rabbitmqctl command line cmd (the program and the
// arguments that choose the node) with args, two minutes at most, and
// returns its output.
func runCtl(cmd []string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, cmd[0], append(slices.Clone(cmd[1:]), args...)...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("rabbitmqctl %s: %w", strings.Join(args, " "), err)
	}
	return string(out), nil
}

// mustCtl is ctl that fails the test on error.
func (r *privateRabbit) mustCtl(t *testing.T, args ...string) {
	t.Helper()
	if out, err := r.ctl(args...); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
}

func (r *privateRabbit) waitAMQP(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		c, err := amqp091.Dial(r.url)
		if err == nil {
			_ = c.Close()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("private RabbitMQ node does not answer: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
