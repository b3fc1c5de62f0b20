package cmd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/control"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// TestWorkerDefaultNodeNameIsUniquePerProcess starts two workers on one host
// without --hostname: each takes the name onceler-<pid>@<host>, and Celery's
// remote control reaches each under its own name.
func TestWorkerDefaultNodeNameIsUniquePerProcess(t *testing.T) {
	t.Parallel()
	s := newStack(t)
	host, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	workers := []*proc{startWorker(t, s.env), startWorker(t, s.env)}
	var nodes []string
	for _, w := range workers {
		node := fmt.Sprintf("onceler-%d@%s", w.cmd.Process.Pid, host)
		w.waitLog(`"node":"`+node+`"`, 10*time.Second)
		nodes = append(nodes, node)
	}
	if nodes[0] == nodes[1] {
		t.Fatalf("two workers share the node name %s", nodes[0])
	}
	for _, node := range nodes {
		// A loaded machine may start the control consumer after the log
		// line: ask again until the node answers.
		var got map[string]map[string]any
		testkit.Eventually(30*time.Second, func() bool {
			got = celeryInspect(t, s.env, node)
			return len(got["ping"]) > 0
		})
		if len(got["ping"]) != 1 || fmt.Sprint(got["ping"][node]) != "map[ok:pong]" {
			t.Fatalf("celery inspect ping of %s: %v", node, got["ping"])
		}
	}
	for _, w := range workers {
		w.stop()
	}
}

// celeryInspect asks node, as "celery inspect" does, for ping and
// registered, and returns the replies by command and node.
func celeryInspect(t *testing.T, env map[string]string, node string) map[string]map[string]any {
	t.Helper()
	ping := start(t, "celery inspect", env, testenv.Python(t), "-c", inspectPy, node)
	if err := ping.wait(60 * time.Second); err != nil {
		t.Fatalf("inspect: %v\n%s", err, ping.stderr.String())
	}
	var got map[string]map[string]any
	if err := json.Unmarshal([]byte(ping.stdout.String()), &got); err != nil {
		t.Fatalf("inspect output %q: %v", ping.stdout.String(), err)
	}
	return got
}

// TestWorkerBrokerTLSOnPlainURL: TLS files on an amqp:// broker URL are a
// usage error of the worker command, found before any connection (the
// worker's and its remote control's alike).
func TestWorkerBrokerTLSOnPlainURL(t *testing.T) {
	t.Parallel()
	f := brokerFlags{url: "amqp://localhost//", certFile: "cert.pem", keyFile: "key.pem"}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var u *usageError
	if _, err := probeBroker(ctx, f.config("n@h"), []amqp.QueueSpec{amqp.CeleryQueue("q1")}); !errors.As(err, &u) {
		t.Fatalf("TLS files on amqp:// = %v, want a usage error", err)
	}
}

// TestWorkerHostnameDefault: --hostname defaults to control's per-process
// pattern, which expands to a name holding this process's id.
func TestWorkerHostnameDefault(t *testing.T) {
	t.Parallel()
	c := workerCommand()
	fs := newFlagSet(c)
	c.setup(&app{getenv: func(string) string { return "" }}, fs)
	def := fs.fs.Lookup("hostname").DefValue
	if def != control.DefaultNodeName {
		t.Fatalf("--hostname default %q, want %q", def, control.DefaultNodeName)
	}
	node, err := control.NodeName(def)
	if err != nil {
		t.Fatal(err)
	}
	if want := fmt.Sprintf("onceler-%d@", os.Getpid()); len(node) <= len(want) || node[:len(want)] != want {
		t.Fatalf("default node name %q, want %s<host>", node, want)
	}
}
