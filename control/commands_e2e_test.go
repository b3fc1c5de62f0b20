package control_test

import (
	"encoding/json"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/onceler/onceler/control"
)

// The run-time commands against the real tasks.Worker with the demo tasks,
// driven by Python Celery's command line and app.control
// (testdata/ops.py): each checks the reply and the effect.

func floats(v any) []float64 {
	l, _ := v.([]any)
	out := make([]float64, 0, len(l))
	for _, x := range l {
		f, _ := x.(float64)
		out = append(out, f)
	}
	return out
}

func asJSON(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

// TestTasksWorkerRateLimit: rate_limit demo.sleep 60/m makes four
// demo.sleep(0) start a second apart, while four demo.add sent after them
// finish at once; rate_limit 0 lifts it. Unknown tasks and bad rates get
// Celery's errors.
func TestTasksWorkerRateLimit(t *testing.T) {
	n := startTasksNode(t, false)
	res := n.Script(t, "ops.py", "rate")
	for k, want := range map[string]any{
		"unknown": map[string]any{"error": "unknown task"},
		"invalid": map[string]any{"error": `Invalid rate limit string: ValueError("could not convert string to float: 'x'")`},
		"set":     map[string]any{"ok": "new rate limit set successfully"},
		"off":     map[string]any{"ok": "rate limit disabled successfully"},
	} {
		if !control.JSONEqual(res[k], want) {
			t.Errorf("%s: reply %v, want %v", k, res[k], want)
		}
	}
	sleeps, adds, free := floats(res["sleep_times"]), floats(res["add_times"]), floats(res["unlimited_times"])
	if len(sleeps) != 4 || len(adds) != 4 || len(free) != 4 {
		t.Fatalf("not all tasks finished: %v", res)
	}
	// 60/m: one start a second; the first at once
	if span := sleeps[3] - sleeps[0]; span < 2.7 {
		t.Errorf("rate-limited demo.sleep finished within %.2fs (%v), want ≥ 3 s apart", span, sleeps)
	}
	if adds[3] > sleeps[1] || adds[3] > 2 {
		t.Errorf("demo.add waited behind the rate limit of demo.sleep: adds %v, sleeps %v", adds, sleeps)
	}
	if !control.JSONEqual(res["add_values"], []any{1, 2, 3, 4}) {
		t.Errorf("add values %v", res["add_values"])
	}
	if span := free[3] - free[0]; span > 2 {
		t.Errorf("after rate_limit 0, demo.sleep still spread over %.2fs (%v)", span, free)
	}
	// the command line gives the same answers
	out := n.Celery(t, "control", "rate_limit", "demo.sleep", "10/h", "-d", n.Name(), "--json")
	if !strings.Contains(string(out), "new rate limit set successfully") {
		t.Errorf("celery control rate_limit: %s", out)
	}
}

// TestTasksWorkerTimeLimit: time_limit demo.sleep 1 2 makes a 20 s sleep
// fail within seconds; time_limit with no limits lets it run again.
func TestTasksWorkerTimeLimit(t *testing.T) {
	n := startTasksNode(t, false)
	res := n.Script(t, "ops.py", "time")
	if !control.JSONEqual(res["unknown"], map[string]any{"error": "unknown task"}) ||
		!control.JSONEqual(res["set"], map[string]any{"ok": "time limits set successfully"}) ||
		!control.JSONEqual(res["reset"], map[string]any{"ok": "time limits set successfully"}) {
		t.Errorf("replies: %v", res)
	}
	if el, _ := res["elapsed"].(float64); el > 8 || res["state"] != "FAILURE" || !strings.Contains(asJSON(res["exc"]), "TimeLimitExceeded") {
		t.Errorf("demo.sleep(20) under a 1 s soft, 2 s hard limit: %v", res)
	}
	if res["after_reset"] == nil {
		t.Errorf("after the reset, demo.sleep(1.5) = %v", res)
	}
	out := n.Celery(t, "control", "time_limit", "demo.sleep", "30", "60", "-d", n.Name(), "--json")
	if !strings.Contains(string(out), "time limits set successfully") {
		t.Errorf("celery control time_limit: %s", out)
	}
}

// TestTasksWorkerAddCancelConsumer: add_consumer makes the worker consume a
// new queue (active_queues lists it, a task sent there runs);
// cancel_consumer stops it (a task sent there stays in the queue).
func TestTasksWorkerAddCancelConsumer(t *testing.T) {
	n := startTasksNode(t, false)
	q := n.Queue() + "_added"
	res := n.Script(t, "ops.py", "queues", q)
	if !control.JSONEqual(res["add"], map[string]any{"ok": "add consumer " + q}) ||
		!control.JSONEqual(res["cancel"], map[string]any{"ok": "no longer consuming from " + q}) {
		t.Errorf("replies: %v", res)
	}
	added, _ := res["queues_added"].([]any)
	cancelled, _ := res["queues_cancelled"].([]any)
	if !slices.Contains(added, any(q)) || !slices.Contains(added, any(n.Queue())) || slices.Contains(cancelled, any(q)) ||
		!slices.Contains(cancelled, any(n.Queue())) {
		t.Errorf("active_queues after add %v, after cancel %v", added, cancelled)
	}
	if res["on_new_queue"] != 42.0 {
		t.Errorf("demo.add on the added queue = %v", res["on_new_queue"])
	}
	if res["after_cancel_state"] != "PENDING" || res["left_in_queue"] != 1.0 {
		t.Errorf("after cancel_consumer, a task sent to %s: %v, %v in the queue", q, res["after_cancel_state"], res["left_in_queue"])
	}
	// the command line, with the queue consumed again and cancelled
	q2 := n.Queue() + "_cli"
	if out := n.Celery(t, "control", "add_consumer", q2, "-d", n.Name(), "--json"); !strings.Contains(string(out), "add consumer "+q2) {
		t.Errorf("celery control add_consumer: %s", out)
	}
	if out := n.Celery(t, "control", "cancel_consumer", q2, "-d", n.Name(), "--json"); !strings.Contains(string(out), "no longer consuming from "+q2) {
		t.Errorf("celery control cancel_consumer: %s", out)
	}
}

// TestTasksWorkerPoolResize: pool_shrink to 2 slots makes six demo.sleep(2)
// run two at a time (about 6 s, never more than 2 active); pool_grow and
// autoscale to 6 run them together (about 2 s). pool_restart is refused.
func TestTasksWorkerPoolResize(t *testing.T) {
	n := startTasksNode(t, false)
	res := n.Script(t, "ops.py", "pool")
	if res["slots_before"] != 4.0 || res["slots_shrunk"] != 2.0 || res["slots_grown"] != 3.0 || res["slots_autoscaled"] != 6.0 {
		t.Errorf("max-concurrency before %v, shrunk %v, grown %v, autoscaled %v", res["slots_before"], res["slots_shrunk"], res["slots_grown"], res["slots_autoscaled"])
	}
	for k, want := range map[string]any{
		"shrink":    map[string]any{"ok": "pool will shrink"},
		"grow":      map[string]any{"ok": "pool will grow"},
		"autoscale": map[string]any{"ok": "autoscale now max=6 min=3"},
	} {
		if !control.JSONEqual(res[k], want) {
			t.Errorf("%s: reply %v, want %v", k, res[k], want)
		}
	}
	if r, _ := res["restart"].(map[string]any); !strings.HasPrefix(asJSON(r["error"]), `"ValueError('Pool restarts not supported`) {
		t.Errorf("pool_restart = %v", res["restart"])
	}
	shrunk, _ := res["shrunk"].(map[string]any)
	grown, _ := res["grown"].(map[string]any)
	if el, _ := shrunk["elapsed"].(float64); el < 5.5 || shrunk["peak"].(float64) > 2 {
		t.Errorf("2 slots: six 2 s tasks took %vs, %v at once at the most", shrunk["elapsed"], shrunk["peak"])
	}
	if el, _ := grown["elapsed"].(float64); el > 4.5 || grown["peak"].(float64) < 3 {
		t.Errorf("6 slots: six 2 s tasks took %vs, %v at once at the most", grown["elapsed"], grown["peak"])
	}
}

// TestTasksWorkerRequestFieldsAndDebug: inspect active gives args and
// kwargs as values (reprs with safe=True) and query_task the same;
// stats.broker is kombu's connection info without the password; conf gives
// Celery's names, more of them with defaults; report, memsample, memdump
// answer in Celery's shapes; objgraph is unsupported.
func TestTasksWorkerRequestFieldsAndDebug(t *testing.T) {
	n := startTasksNode(t, false)
	res := n.Script(t, "ops.py", "fields")
	active, _ := res["active"].([]any)
	safe, _ := res["active_safe"].([]any)
	if len(active) != 1 || len(safe) != 1 {
		t.Fatalf("active %v, safe %v", res["active"], res["active_safe"])
	}
	a, s := active[0].(map[string]any), safe[0].(map[string]any)
	kw, _ := a["kwargs"].(map[string]any)
	if kw["seconds"] != 3.0 || !strings.HasPrefix(asJSON(kw["op"]), `"fields-`) || !control.JSONEqual(a["args"], []any{}) {
		t.Errorf("active args %v kwargs %v: want the values", a["args"], a["kwargs"])
	}
	if ks, _ := s["kwargs"].(string); !strings.Contains(ks, "'seconds': 3") || s["args"] != "()" {
		t.Errorf("active(safe=True) args %v kwargs %v: want the reprs", s["args"], s["kwargs"])
	}
	if q, _ := res["query"].(map[string]any); len(q) != 1 {
		t.Errorf("query_task = %v", res["query"])
	} else {
		for _, v := range q {
			l, _ := v.([]any)
			if len(l) != 2 || l[0] != "active" || !control.JSONEqual(l[1].(map[string]any)["kwargs"], kw) {
				t.Errorf("query_task = %v", v)
			}
		}
	}
	b, _ := res["broker"].(map[string]any)
	for k, want := range map[string]any{"hostname": "127.0.0.1", "port": 5672.0, "userid": "guest", "virtual_host": "/", "transport": "amqp", "ssl": false, "heartbeat": 10.0} {
		if b[k] != want {
			t.Errorf("stats broker %s = %v, want %v (%v)", k, b[k], want, b)
		}
	}
	if _, leak := b["password"]; leak || strings.Contains(asJSON(res), "guest:guest") {
		t.Errorf("the broker password is in a reply: %v", b)
	}
	conf, _ := res["conf"].(map[string]any)
	full, _ := res["conf_defaults"].(map[string]any)
	if conf["task_acks_late"] != true || conf["worker_concurrency"] != 4.0 || conf["enable_utc"] != nil {
		t.Errorf("conf = %v", conf)
	}
	if full["task_acks_late"] != true || full["enable_utc"] != true || full["event_exchange"] != "celeryev" || len(full) <= len(conf) {
		t.Errorf("conf(with_defaults=True) = %v", full)
	}
	if r, _ := res["report"].(map[string]any); !strings.Contains(fmt.Sprint(r["ok"]), "software -> onceler:") || !strings.Contains(fmt.Sprint(r["ok"]), "worker_concurrency: 4") {
		t.Errorf("report = %v", res["report"])
	}
	mem := regexp.MustCompile(`^[0-9]+(\.[0-9]+)?(b|KB|MB|GB|TB)$`)
	if s, _ := res["memsample"].(string); !mem.MatchString(s) {
		t.Errorf("memsample = %v", res["memsample"])
	}
	dump := regexp.MustCompile(`^- rss \(sample\):\n(-    > [0-9.]+(b|KB|MB|GB),\n){2}- rss \(end\): [0-9.]+(b|KB|MB|GB)\.\n$`)
	if s, _ := res["memdump"].(string); !dump.MatchString(s) {
		t.Errorf("memdump = %q", res["memdump"])
	}
	if r, _ := res["objgraph"].(map[string]any); !strings.HasPrefix(asJSON(r["error"]), `"NotImplementedError('objgraph is not supported`) {
		t.Errorf("objgraph = %v", res["objgraph"])
	}
}

// TestTasksWorkerDemoAddAsPython: demo.add answers as Python's x + y.
func TestTasksWorkerDemoAddAsPython(t *testing.T) {
	n := startTasksNode(t, false)
	res := n.Script(t, "ops.py", "add")
	want := map[string]any{
		"big":   map[string]any{"repr": "100000000000000001", "type": "int"},
		"float": map[string]any{"repr": "3.0", "type": "float"},
		"int":   map[string]any{"repr": "5", "type": "int"},
		"half":  map[string]any{"repr": "1.5", "type": "float"},
	}
	for k, w := range want {
		if !control.JSONEqual(res[k], w) {
			t.Errorf("demo.add %s = %v, want %v", k, res[k], w)
		}
	}
}

// TestTasksWorkerSeesTasksOnArrival: with both task slots of a worker busy,
// five more tasks get task-received within 100 ms of being published (a
// Python event receiver), inspect reserved and query_task list them with
// their name and arguments, and a countdown task is in scheduled (with its
// eta), not in reserved.
func TestTasksWorkerSeesTasksOnArrival(t *testing.T) {
	n, start := prepareTasksNodeWith(t, true, 2)
	start()
	res := n.Script(t, "ops.py", "arrival")
	if res["active_before"] != float64(2) {
		t.Fatalf("slots not filled: %v", res)
	}
	sent, _ := res["sent"].(map[string]any)
	received, _ := res["received"].(map[string]any)
	if len(sent) != 5 {
		t.Fatalf("sent %v", sent)
	}
	want := map[string][]any{}
	for id, at := range sent {
		ev, _ := received[id].([]any)
		if len(ev) != 3 {
			t.Errorf("%s: no task-received (received %v)", id, received)
			continue
		}
		if lag := ev[0].(float64) - at.(float64); lag > 0.1 {
			t.Errorf("%s: task-received %.0f ms after publishing, want ≤ 100 ms", id, lag*1000)
		}
		if ev[1] != "demo.add" {
			t.Errorf("%s: task-received %v", id, ev)
		}
	}
	reserved, _ := res["reserved"].([]any)
	for _, r := range reserved {
		req, _ := r.(map[string]any)
		id, _ := req["id"].(string)
		if id == res["later"] {
			t.Errorf("the countdown task is in reserved: %v", req)
		}
		if _, ok := sent[id]; !ok {
			continue
		}
		args, _ := req["args"].([]any)
		di, _ := req["delivery_info"].(map[string]any)
		if req["name"] != "demo.add" || req["type"] != "demo.add" || len(args) != 2 || args[1].(float64) != args[0].(float64)+1000 ||
			req["kwargs"] == nil || di["routing_key"] == nil {
			t.Errorf("reserved request %v", req)
		}
		want[id] = args
	}
	if len(want) != 5 {
		t.Errorf("reserved lists %d of the 5 waiting tasks: %v", len(want), reserved)
	}
	query, _ := res["query"].(map[string]any)
	for id := range sent {
		q, _ := query[id].([]any)
		if len(q) != 2 || q[0] != "reserved" {
			t.Errorf("query_task %s: %v", id, query[id])
			continue
		}
		if req, _ := q[1].(map[string]any); req["name"] != "demo.add" || asJSON(req["args"]) != asJSON(want[id]) {
			t.Errorf("query_task %s: %v", id, q)
		}
	}
	scheduled, _ := res["scheduled"].([]any)
	found := false
	for _, s := range scheduled {
		e, _ := s.(map[string]any)
		req, _ := e["request"].(map[string]any)
		if req["id"] == res["later"] {
			found = e["eta"] != nil && req["name"] == "demo.add" && asJSON(req["args"]) == "[7,8]"
		}
	}
	if !found {
		t.Errorf("countdown task %v not in scheduled with its eta and request: %v", res["later"], scheduled)
	}
	if asJSON(res["values"]) != "[1000,1002,1004,1006,1008]" {
		t.Errorf("values %v", res["values"])
	}
}
