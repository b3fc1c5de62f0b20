package integration

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
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
	cmd            *exec.Cmd
	done           chan struct{}
}

// rabbitConfig is what a private node is started with beyond its
// listener: extra rabbitmq.conf lines (e.g. "consumer_timeout = 5000"),
// and an advanced.config (Erlang terms) for settings rabbitmq.conf has no
// key for.
type rabbitConfig struct {
	conf     []string
	advanced string
}

// startRabbit starts a private RabbitMQ node, stopped and removed when the
// test ends. It needs rabbitmq-server and root (to run it as the rabbitmq
// user, who owns the Erlang cookie).
func startRabbit(t *testing.T) *privateRabbit {
	t.Helper()
	return startRabbitWith(t, rabbitConfig{})
}

// startRabbitWith is startRabbit with settings of the test's own.
func startRabbitWith(t *testing.T, rc rabbitConfig) *privateRabbit {
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
	r := &privateRabbit{node: testenv.Name("onceler_fault") + "@localhost", dir: dir, done: make(chan struct{}),
		url: fmt.Sprintf("amqp://guest:guest@127.0.0.1:%d/", port)}
	conf := fmt.Sprintf("listeners.tcp.1 = 127.0.0.1:%d\nloopback_users = none\n", port)
	for _, line := range rc.conf {
		conf += line + "\n"
	}
	advanced := rc.advanced
	if advanced == "" {
		advanced = "[]."
	}
	files := map[string]string{
		"rabbitmq.conf":   conf,
		"advanced.config": advanced + "\n",
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
	log, err := os.Create(filepath.Join(dir, "server.out"))
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close()
	r.cmd = exec.Command("runuser", "-u", "rabbitmq", "--", "env", "HOME=/var/lib/rabbitmq",
		"RABBITMQ_NODENAME="+r.node, fmt.Sprintf("RABBITMQ_DIST_PORT=%d", dist),
		"RABBITMQ_MNESIA_BASE="+filepath.Join(dir, "mnesia"), "RABBITMQ_LOG_BASE="+filepath.Join(dir, "log"),
		"RABBITMQ_ENABLED_PLUGINS_FILE="+filepath.Join(dir, "plugins"),
		"RABBITMQ_CONFIG_FILE="+filepath.Join(dir, "rabbitmq.conf"),
		"RABBITMQ_ADVANCED_CONFIG_FILE="+filepath.Join(dir, "advanced.config"),
		"RABBITMQ_PID_FILE="+filepath.Join(dir, "pid"), server)
	r.cmd.Stdout, r.cmd.Stderr = log, log
	if err := r.cmd.Start(); err != nil {
		t.Fatalf("start rabbitmq-server: %v", err)
	}
	go func() {
		_ = r.cmd.Wait()
		close(r.done)
	}()
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
	if out, err := r.ctl("wait", filepath.Join(dir, "pid"), "--timeout", "120"); err != nil {
		b, _ := os.ReadFile(filepath.Join(dir, "server.out"))
		t.Fatalf("private RabbitMQ node did not start: %v\n%s\n%s", err, out, b)
	}
	r.waitAMQP(t)
	return r
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
