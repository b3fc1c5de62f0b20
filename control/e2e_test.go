package control

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/tasks"
)

// startTasksNode runs the real tasks.Worker with the demo tasks, its
// controller as Observer, until the test ends.
func startTasksNode(t *testing.T, taskEvents bool) *node {
	t.Helper()
	n, start := prepareTasksNode(t, taskEvents)
	start()
	return n
}

// prepareTasksNode makes the worker and its controller; start runs them
// until the test ends and waits until they are ready.
func prepareTasksNode(t *testing.T, taskEvents bool) (*node, func()) {
	t.Helper()
	url := testenv.AMQPURL(t)
	py := testenv.Python(t)
	pool := testenv.Pool(t)
	schema := testenv.Schema(t, pool)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	store, err := idempotency.New(pool, idempotency.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(store.Close)
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if err := demo.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	reg := tasks.NewRegistry()
	if err := demo.Register(reg, pool); err != nil {
		t.Fatal(err)
	}
	suffix := strings.TrimPrefix(testenv.Name("t"), "t_")
	n := &node{queue: "onceler_ctl_" + suffix, url: url, py: py, shutdown: make(chan struct{}), extraEnv: []string{"ONCELER_SLEEP_KWARGS=1"}}
	queues := []amqp.QueueSpec{amqp.CeleryQueue(n.queue)}
	name, err := NodeName("onceler-" + suffix + "@%h")
	if err != nil {
		t.Fatal(err)
	}
	log := zaptest.NewLogger(t)
	ctl, err := New(nil, Config{URL: url, NodeName: name, TaskEvents: taskEvents, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	w, err := tasks.NewWorker(reg, tasks.Config{
		Broker: amqp.Config{URL: url, Name: "onceler worker " + name}, Queues: queues, Store: store, Pool: pool,
		Concurrency: 4, Lease: 10 * time.Second, Grace: 5 * time.Second, Hostname: name, Observer: ctl, Logger: log,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctl.SetWorker(FromTasks(w))
	n.ctl, n.name = ctl, name
	start := func() {
		runCtx, stop := context.WithCancel(context.Background())
		var wg sync.WaitGroup
		wg.Add(2)
		go func() {
			defer wg.Done()
			if err := w.Run(runCtx); err != nil {
				t.Errorf("worker: %v", err)
			}
		}()
		go func() {
			defer wg.Done()
			if err := ctl.Run(runCtx); err != nil {
				t.Errorf("controller: %v", err)
			}
		}()
		t.Cleanup(func() { stop(); wg.Wait() })
		deadline := time.Now().Add(20 * time.Second)
		for !w.Ready() || !ctl.connected.Load() {
			if time.Now().After(deadline) {
				t.Fatal("worker or controller not ready")
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	return n, start
}

func TestTasksWorkerInspectAndRevoke(t *testing.T) {
	n := startTasksNode(t, false)
	if got := n.inspect(t, "ping"); !jsonEqual(got, map[string]any{"ok": "pong"}) {
		t.Errorf("ping = %v", got)
	}
	reg, _ := n.inspect(t, "registered").([]any)
	for _, want := range []string{demo.TaskSleep, demo.TaskAdd} {
		found := false
		for _, r := range reg {
			found = found || r == want
		}
		if !found {
			t.Errorf("registered = %v, missing %s", reg, want)
		}
	}
	queues, _ := n.inspect(t, "active_queues").([]any)
	if len(queues) != 1 || queues[0].(map[string]any)["name"] != n.queue || queues[0].(map[string]any)["queue_arguments"] != nil ||
		queues[0].(map[string]any)["durable"] != true {
		t.Errorf("active_queues = %v", queues)
	}
	t.Run("revoke before run", func(t *testing.T) {
		res := n.client(t, "revoke-before", "0.1")
		if res["exc"] != "TaskRevokedError" || res["state"] != "REVOKED" || res["msg"] != "revoked" {
			t.Fatalf("revoked before run: %v", res)
		}
	})
	t.Run("terminate running", func(t *testing.T) {
		res := n.client(t, "terminate", "30", "cli")
		if res["seen_active"] != true {
			t.Fatalf("demo.sleep never in inspect active: %v", res)
		}
		if el, _ := res["elapsed"].(float64); el > 10 {
			t.Errorf("terminate took %.1fs", el)
		}
		if res["exc"] != "TaskRevokedError" || res["state"] != "REVOKED" {
			t.Fatalf("terminated task: %v", res)
		}
		if res["msg"] != "terminated" {
			t.Errorf("TaskRevokedError(%v), want terminated", res["msg"])
		}
	})
}

func TestTasksWorkerEvents(t *testing.T) {
	n, start := prepareTasksNode(t, false)
	checkCeleryEvents(t, n, start, "5")
}
