package control_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/control"
	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/tasks"
)

// startTasksNode runs the real tasks.Worker with the demo tasks, and its own
// remote control, until the test ends.
func startTasksNode(t *testing.T, taskEvents bool) *control.PyNode {
	t.Helper()
	n, start := prepareTasksNode(t, taskEvents)
	start()
	return n
}

// prepareTasksNode makes the worker; start runs it until the test ends and
// waits until it consumes and its remote control is connected.
func prepareTasksNode(t *testing.T, taskEvents bool) (*control.PyNode, func()) {
	t.Helper()
	return prepareTasksNodeWith(t, taskEvents, 4)
}

// prepareTasksNodeWith is prepareTasksNode with concurrency task slots.
func prepareTasksNodeWith(t *testing.T, taskEvents bool, concurrency int) (*control.PyNode, func()) {
	t.Helper()
	url := testenv.AMQPURL(t)
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
	queue := "onceler_ctl_" + suffix
	name, err := control.NodeName("onceler-" + suffix + "@%h")
	if err != nil {
		t.Fatal(err)
	}
	n := control.NewPyNode(t, name, queue, url, "ONCELER_SLEEP_KWARGS=1")
	w, err := tasks.NewWorker(reg, tasks.Config{
		Broker: amqp.Config{URL: url, Name: "onceler worker " + name}, Queues: []amqp.QueueSpec{amqp.CeleryQueue(queue)},
		Store: store, Pool: pool, Concurrency: concurrency, Lease: 10 * time.Second, Grace: 5 * time.Second, Hostname: name,
		TaskEvents: taskEvents, Logger: zaptest.NewLogger(t),
	})
	if err != nil {
		t.Fatal(err)
	}
	return n, func() { runWorker(t, w) }
}

// runWorker runs w until the test ends and waits until it consumes and its
// remote control is connected; done is closed when Run returns.
func runWorker(t *testing.T, w *tasks.Worker) (done <-chan struct{}) {
	t.Helper()
	runCtx, stop := context.WithCancel(context.Background())
	ended := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer close(ended)
		if err := w.Run(runCtx); err != nil {
			t.Errorf("worker: %v", err)
		}
	}()
	t.Cleanup(func() { stop(); wg.Wait() })
	deadline := time.Now().Add(20 * time.Second)
	for !w.Ready() || !control.Connected(w.Controller()) {
		if time.Now().After(deadline) {
			t.Fatal("worker or its remote control not ready")
		}
		time.Sleep(20 * time.Millisecond)
	}
	return ended
}

func TestTasksWorkerInspectAndRevoke(t *testing.T) {
	n := startTasksNode(t, false)
	if got := n.Inspect(t, "ping"); !control.JSONEqual(got, map[string]any{"ok": "pong"}) {
		t.Errorf("ping = %v", got)
	}
	reg, _ := n.Inspect(t, "registered").([]any)
	for _, want := range []string{demo.TaskSleep, demo.TaskAdd} {
		found := false
		for _, r := range reg {
			found = found || r == want
		}
		if !found {
			t.Errorf("registered = %v, missing %s", reg, want)
		}
	}
	queues, _ := n.Inspect(t, "active_queues").([]any)
	if len(queues) != 1 || queues[0].(map[string]any)["name"] != n.Queue() || queues[0].(map[string]any)["queue_arguments"] != nil ||
		queues[0].(map[string]any)["durable"] != true {
		t.Errorf("active_queues = %v", queues)
	}
	t.Run("revoke before run", func(t *testing.T) {
		res := n.Client(t, "revoke-before", "0.1")
		if res["exc"] != "TaskRevokedError" || res["state"] != "REVOKED" || res["msg"] != "revoked" {
			t.Fatalf("revoked before run: %v", res)
		}
	})
	t.Run("terminate running", func(t *testing.T) {
		res := n.Client(t, "terminate", "30", "cli")
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
	control.CheckCeleryEvents(t, n, start, "5")
}

type addArgs struct {
	X int `celery:"x"`
	Y int `celery:"y"`
}

// TestTasksWorkerDefaultControl: a worker made with tasks.NewWorker and
// nothing but its broker, queue and tasks (default logger, node name and
// remote control) answers real Python Celery's 'celery inspect ping' under
// its default node name, sends worker-online and heartbeats, answers
// enable_events and disable_events, and stops (Run returns nil) at 'celery
// control shutdown', as the onceler command's worker does.
func TestTasksWorkerDefaultControl(t *testing.T) {
	url := testenv.AMQPURL(t)
	queue := "onceler_ctl_" + strings.TrimPrefix(testenv.Name("t"), "t_")
	reg := tasks.NewRegistry()
	err := tasks.Register(reg, tasks.Task[addArgs]{Name: demo.TaskAdd, Mode: tasks.ModePure,
		Run: func(_ context.Context, _ *tasks.Call, a addArgs) (any, error) { return a.X + a.Y, nil }})
	if err != nil {
		t.Fatal(err)
	}
	w, err := tasks.NewWorker(reg, tasks.Config{Broker: amqp.Config{URL: url}, Queues: []amqp.QueueSpec{amqp.CeleryQueue(queue)}})
	if err != nil {
		t.Fatal(err)
	}
	n := control.NewPyNode(t, w.Hostname(), queue, url)
	var done <-chan struct{}
	control.CheckCeleryEvents(t, n, func() { done = runWorker(t, w) }, "5")
	if got := n.Inspect(t, "ping"); !control.JSONEqual(got, map[string]any{"ok": "pong"}) {
		t.Errorf("celery inspect ping of %s = %v", w.Hostname(), got)
	}
	n.Celery(t, "control", "shutdown", "-d", w.Hostname())
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		t.Fatal("celery control shutdown did not stop the worker")
	}
}
