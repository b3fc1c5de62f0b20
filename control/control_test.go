package control

import (
	"bufio"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap/zaptest"

	"github.com/onceler/onceler/internal/testenv"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

type node struct {
	name, queue, url, py string
	ctl                  *Controller
	worker               *testWorker
	shutdown             chan struct{}
	extraEnv             []string

	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// startNode runs a test worker and its controller until the test ends.
func startNode(t *testing.T, taskEvents bool) *node {
	t.Helper()
	n := newNode(t, taskEvents)
	n.start(t)
	return n
}

// newNode prepares a test worker and its controller; start runs them.
func newNode(t *testing.T, taskEvents bool) *node {
	t.Helper()
	url := testenv.AMQPURL(t)
	py := testenv.Python(t)
	suffix := strings.TrimPrefix(testenv.Name("t"), "t_")
	n := &node{queue: "onceler_ctl_" + suffix, url: url, py: py, shutdown: make(chan struct{})}
	n.worker = newTestWorker(t, url, n.queue, "")
	var once sync.Once
	ctl, err := New(n.worker, Config{
		URL: url, NodeName: "onceler-" + suffix + "@%h", TaskEvents: taskEvents, ConnectionName: "onceler_control_test_" + suffix,
		Concurrency: 2, Prefetch: 2,
		Shutdown: func() { once.Do(func() { close(n.shutdown) }) },
		Logger:   zaptest.NewLogger(t),
	})
	if err != nil {
		t.Fatal(err)
	}
	n.ctl, n.name = ctl, ctl.NodeName()
	n.worker.node, n.worker.observer = n.name, ctl
	t.Cleanup(n.stop)
	return n
}

func (n *node) start(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	n.cancel = cancel
	n.wg.Add(2)
	go func() {
		defer n.wg.Done()
		if err := n.worker.run(ctx, 2); err != nil {
			t.Errorf("test worker: %v", err)
		}
	}()
	go func() {
		defer n.wg.Done()
		if err := n.ctl.Run(ctx); err != nil {
			t.Errorf("controller: %v", err)
		}
	}()
	deadline := time.Now().Add(10 * time.Second)
	for !n.ctl.connected.Load() {
		if time.Now().After(deadline) {
			t.Fatal("controller did not connect")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// stop ends the worker and the controller and waits for them.
func (n *node) stop() {
	if n.cancel != nil {
		n.cancel()
	}
	n.wg.Wait()
}

func (n *node) env() []string {
	env := append(os.Environ(), "ONCELER_BROKER="+n.url, "ONCELER_QUEUE="+n.queue, "PYTHONDONTWRITEBYTECODE=1")
	return append(env, n.extraEnv...)
}

// celery runs the celery command line with the test app.
func (n *node) celery(t *testing.T, args ...string) []byte {
	t.Helper()
	cmd := exec.Command(n.py, append([]string{"-m", "celery", "-A", "app"}, args...)...)
	cmd.Dir = "testdata"
	cmd.Env = n.env()
	out, err := cmd.Output()
	if err != nil {
		var stderr string
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = string(ee.Stderr)
		}
		t.Fatalf("celery %v: %v\n%s\n%s", args, err, out, stderr)
	}
	return out
}

// inspect runs `celery inspect <method> -d <node> --json` and returns this
// node's reply.
func (n *node) inspect(t *testing.T, method string) any {
	t.Helper()
	out := n.celery(t, "inspect", method, "-d", n.name, "--json")
	var replies map[string]any
	if err := json.Unmarshal(out, &replies); err != nil {
		t.Fatalf("inspect %s output %q: %v", method, out, err)
	}
	r, ok := replies[n.name]
	if !ok {
		t.Fatalf("inspect %s: no reply from %s in %s", method, n.name, out)
	}
	return r
}

// client runs testdata/client.py and decodes its JSON line.
func (n *node) client(t *testing.T, args ...string) map[string]any {
	t.Helper()
	return n.script(t, "client.py", args...)
}

// script runs testdata/<name> NODE args... and decodes its JSON line.
func (n *node) script(t *testing.T, name string, args ...string) map[string]any {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, n.py, append([]string{name, n.name}, args...)...)
	cmd.Dir = "testdata"
	cmd.Env = n.env()
	out, err := cmd.Output()
	if err != nil {
		var stderr string
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = string(ee.Stderr)
		}
		t.Fatalf("%s %v: %v\n%s\n%s", name, args, err, out, stderr)
	}
	var res map[string]any
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("%s output %q: %v", name, out, err)
	}
	return res
}

func TestCeleryInspect(t *testing.T) {
	n := startNode(t, false)

	if got := n.inspect(t, "ping"); !jsonEqual(got, map[string]any{"ok": "pong"}) {
		t.Errorf("ping = %v", got)
	}
	if got := n.inspect(t, "registered"); !jsonEqual(got, []any{"demo.add", "demo.sleep"}) {
		t.Errorf("registered = %v", got)
	}

	// a running demo.sleep shows in inspect active
	done := make(chan map[string]any, 1)
	go func() {
		cmd := exec.Command(n.py, "client.py", n.name, "call", "3")
		cmd.Dir, cmd.Env = "testdata", n.env()
		out, _ := cmd.Output()
		var res map[string]any
		_ = json.Unmarshal(out, &res)
		done <- res
	}()
	var active []any
	deadline := time.Now().Add(15 * time.Second)
	for len(active) == 0 && time.Now().Before(deadline) {
		active, _ = n.inspect(t, "active").([]any)
	}
	if len(active) != 1 {
		t.Fatalf("active = %v, want the running demo.sleep", active)
	}
	task := active[0].(map[string]any)
	if task["name"] != "demo.sleep" || task["type"] != "demo.sleep" || task["hostname"] != n.name ||
		task["args"] != "(3,)" || task["id"] == "" || task["time_start"] == nil {
		t.Errorf("active task = %v", task)
	}
	if di, _ := task["delivery_info"].(map[string]any); di["routing_key"] != n.queue {
		t.Errorf("delivery_info = %v", task["delivery_info"])
	}
	stats, _ := n.inspect(t, "stats").(map[string]any)
	if pid, _ := stats["pid"].(float64); int(pid) != os.Getpid() || stats["pool"] == nil || stats["rusage"] == nil {
		t.Errorf("stats = %v", stats)
	}
	queues, _ := n.inspect(t, "active_queues").([]any)
	if len(queues) != 1 || queues[0].(map[string]any)["name"] != n.queue ||
		!jsonEqual(queues[0].(map[string]any)["queue_arguments"], map[string]any{"x-max-priority": 10}) {
		t.Errorf("active_queues = %v", queues)
	}
	if got := n.inspect(t, "reserved"); !jsonEqual(got, []any{}) {
		t.Errorf("reserved = %v", got)
	}
	if got := n.inspect(t, "scheduled"); !jsonEqual(got, []any{}) {
		t.Errorf("scheduled = %v", got)
	}
	res := <-done
	if res["value"] != 3.0 || res["state"] != "SUCCESS" {
		t.Fatalf("demo.sleep(3) = %v", res)
	}
	stats, _ = n.inspect(t, "stats").(map[string]any)
	if total, _ := stats["total"].(map[string]any); total["demo.sleep"] != 1.0 {
		t.Errorf("stats total = %v", stats["total"])
	}
}

func TestCeleryRevokeBeforeRun(t *testing.T) {
	n := startNode(t, false)
	res := n.client(t, "revoke-before", "0.1")
	if res["exc"] != "TaskRevokedError" || res["state"] != "REVOKED" {
		t.Fatalf("revoked before run: %v", res)
	}
	rv, _ := res["revoke"].(map[string]any)
	if rc, _ := rv["rc"].(float64); rc != 0 || !strings.Contains(rv["stdout"].(string), "flagged as revoked") {
		t.Errorf("celery control revoke: %v", rv)
	}
	if n.ctl.Revoked().Len() != 1 {
		t.Errorf("revoked set holds %d ids", n.ctl.Revoked().Len())
	}
	if got, _ := n.inspect(t, "revoked").([]any); len(got) != 1 {
		t.Errorf("inspect revoked = %v", got)
	}
}

func TestCeleryTerminate(t *testing.T) {
	n := startNode(t, false)
	for _, mode := range []string{"cli", "api"} {
		t.Run(mode, func(t *testing.T) {
			res := n.client(t, "terminate", "30", mode)
			if res["seen_active"] != true {
				t.Fatalf("task never active: %v", res)
			}
			if res["exc"] != "TaskRevokedError" || res["state"] != "REVOKED" || res["msg"] != "terminated" {
				t.Fatalf("terminated task: %v", res)
			}
			if el, _ := res["elapsed"].(float64); el > 10 {
				t.Errorf("terminate took %.1fs", el)
			}
			if !strings.Contains(mustJSON(t, res["terminate"]), "terminate: ") {
				t.Errorf("terminate reply: %v", res["terminate"])
			}
		})
	}
}

func TestCeleryEvents(t *testing.T) {
	n := newNode(t, false)
	checkCeleryEvents(t, n, func() { n.start(t) }, "5")
	// worker-offline at stop
	n.stop()
	if n.ctl.TaskEvents() {
		t.Error("task events still on after disable_events")
	}
}

// checkCeleryEvents runs testdata/events.py against node n: start must start
// the node once the receiver listens. wantResult is the repr of 2 + 3 the
// node's task events carry.
func checkCeleryEvents(t *testing.T, n *node, start func(), wantResult string) {
	t.Helper()
	cmd := exec.Command(n.py, "events.py", n.name)
	cmd.Dir, cmd.Env = "testdata", n.env()
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := bufio.NewScanner(stdout)
	lines.Buffer(nil, 1<<20)
	if !lines.Scan() || lines.Text() != "ready" {
		_ = cmd.Wait()
		t.Fatalf("events.py did not start: %q %s", lines.Text(), stderr.String())
	}
	// Another worker on the broker sends its events before this node starts
	// (as the other tests' workers do): the script must wait for the node's.
	otherWorkerOnline(t)
	start() // worker-online goes to the receiver's queue
	var out map[string]any
	if lines.Scan() {
		_ = json.Unmarshal(lines.Bytes(), &out)
	}
	if err := cmd.Wait(); err != nil || out == nil {
		t.Fatalf("events.py: %v %s %s", err, lines.Text(), stderr.String())
	}
	var types []string
	byTask := map[string][]string{}
	for _, s := range out["seen"].([]any) {
		p := s.([]any)
		types = append(types, p[0].(string))
		if id, ok := p[1].(string); ok {
			byTask[id] = append(byTask[id], p[0].(string))
		}
	}
	if len(types) == 0 || types[0] != "worker-online" {
		t.Errorf("first event = %v, want worker-online", types)
	}
	if c := count(types, "worker-heartbeat"); c < 2 {
		t.Errorf("%d heartbeats", c)
	}
	first, _ := out["first_id"].(string)
	if got := byTask[first]; !slices.Equal(got, []string{"task-received", "task-started", "task-succeeded"}) {
		t.Errorf("task events of %s = %v", first, got)
	}
	second, _ := out["second_id"].(string)
	if second == "" || len(byTask[second]) != 0 || out["second_value"] != 9.0 {
		t.Errorf("after disable_events: %s events %v value %v", second, byTask[second], out["second_value"])
	}
	if alive, _ := out["alive"].([]any); !slices.Contains(alive, any(n.name)) {
		t.Errorf("alive workers = %v, want %s", alive, n.name)
	}
	task, _ := out["task"].(map[string]any)
	if task["state"] != "SUCCESS" || task["name"] != "demo.add" || task["worker"] != n.name || task["result"] != wantResult || task["args"] != "(2, 3)" {
		t.Errorf("State's task = %v", task)
	}
	w, _ := out["worker"].(map[string]any)
	if w["alive"] != true || w["freq"] != 2.0 || w["sw_ident"] != "onceler" {
		t.Errorf("State's worker = %v", w)
	}
	if !strings.Contains(mustJSON(t, out["enable"]), "task events enabled") || !strings.Contains(mustJSON(t, out["disable"]), "task events disabled") {
		t.Errorf("enable/disable replies: %v %v", out["enable"], out["disable"])
	}
	t.Logf("events seen from %s: %v", n.name, types)
}

// otherWorkerOnline starts another node and waits until its worker-online
// is published.
func otherWorkerOnline(t *testing.T) {
	t.Helper()
	other := startNode(t, false)
	deadline := time.Now().Add(10 * time.Second)
	for sent, _, _ := other.ctl.Counters(); sent == 0; sent, _, _ = other.ctl.Counters() {
		if time.Now().After(deadline) {
			t.Fatal("the other node's worker-online was not published")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func count(xs []string, x string) int {
	c := 0
	for _, y := range xs {
		if y == x {
			c++
		}
	}
	return c
}

func jsonEqual(a, b any) bool { return mustJSONAny(a) == mustJSONAny(b) }

func mustJSONAny(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestCeleryShutdownAndPattern(t *testing.T) {
	n := startNode(t, false)
	// a pattern that does not match this node: no reply, no shutdown
	cmd := exec.Command(n.py, "-c", `
import json, sys
sys.path.insert(0, '.')
from app import app
other = app.control.broadcast('ping', reply=True, timeout=1, pattern='celery@*', matcher='glob')
mine = app.control.broadcast('ping', reply=True, timeout=1, pattern=sys.argv[1].split('@')[0] + '@*', matcher='glob')
print(json.dumps({'other': other, 'mine': mine}))
`, n.name)
	cmd.Dir, cmd.Env = "testdata", n.env()
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("pattern ping: %v", err)
	}
	var got struct{ Other, Mine []map[string]any }
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatalf("%s: %v", out, err)
	}
	for _, r := range got.Other {
		if _, ok := r[n.name]; ok {
			t.Errorf("answered a pattern that does not match it: %v", got.Other)
		}
	}
	if len(got.Mine) != 1 || !jsonEqual(got.Mine[0][n.name], map[string]any{"ok": "pong"}) {
		t.Errorf("pattern ping = %v", got.Mine)
	}

	n.celery(t, "control", "shutdown", "-d", n.name)
	select {
	case <-n.shutdown:
	case <-time.After(5 * time.Second):
		t.Fatal("celery control shutdown did not reach Config.Shutdown")
	}
}

// TestPythonWorkerMingle starts a Python Celery worker beside the node: its
// mingle (hello) must sync with the node and learn the ids revoked there, and
// its gossip must read the node's heartbeats without error.
func TestPythonWorkerMingle(t *testing.T) {
	n := startNode(t, false)
	id := "mingle-" + strings.TrimPrefix(testenv.Name("t"), "t_")
	n.celery(t, "control", "revoke", id, "-d", n.name)

	pyNode := "py-" + strings.TrimPrefix(testenv.Name("t"), "t_") + "@vm"
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, n.py, "-m", "celery", "-A", "app", "worker", "-n", pyNode,
		"-Q", n.queue+"_py", "--pool=solo", "--loglevel=info")
	cmd.Dir, cmd.Env = "testdata", n.env()
	var log strings.Builder
	cmd.Stdout, cmd.Stderr = &log, &log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	stopped := false
	stop := func() string {
		if !stopped {
			stopped = true
			_ = cmd.Process.Signal(os.Interrupt)
			_ = cmd.Wait()
		}
		return log.String()
	}
	defer stop()
	var revoked []any
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) && !slices.Contains(revoked, any(id)) {
		time.Sleep(500 * time.Millisecond)
		out := exec.Command(n.py, "-m", "celery", "-A", "app", "inspect", "revoked", "-d", pyNode, "--json")
		out.Dir, out.Env = "testdata", n.env()
		b, err := out.Output()
		if err != nil {
			continue // not up yet
		}
		var replies map[string][]any
		if json.Unmarshal(b, &replies) == nil {
			revoked = replies[pyNode]
		}
	}
	logged := stop()
	if !slices.Contains(revoked, any(id)) {
		t.Fatalf("the Python worker did not learn %s from the node's hello reply; it holds %v\n%s", id, revoked, logged)
	}
	if !strings.Contains(logged, "mingle: sync with") {
		t.Errorf("no mingle sync in the Python worker's log:\n%s", logged)
	}
	if strings.Contains(logged, "Traceback") {
		t.Errorf("the Python worker logged an error:\n%s", logged)
	}
}

func TestRunStopsWhileUnreachable(t *testing.T) {
	c, err := New(nil, Config{URL: "amqp://guest:guest@10.255.255.1:5672/", NodeName: "n@h", MinBackoff: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	time.Sleep(300 * time.Millisecond)
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run = %v", err)
		}
	case <-time.After(3 * time.Second):
		t.Fatal("Run did not return after cancel while dialling")
	}
	if err := c.Run(context.Background()); err == nil {
		t.Fatal("second Run accepted")
	}
}
