package control

import (
	"context"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/onceler/onceler/celeryproto"
)

func TestRevokedBoundAndExpiry(t *testing.T) {
	r := NewRevoked(3, time.Minute)
	now := time.Unix(1000, 0)
	r.now = func() time.Time { return now }
	r.Add("a", "b", "c")
	r.Add("d") // "a" is the oldest: it goes
	if r.Contains("a") || !r.Contains("b") || !r.Contains("d") || r.Len() != 3 {
		t.Fatalf("after overflow: %v", r.IDs())
	}
	now = now.Add(30 * time.Second)
	r.Add("b") // refreshed: now the newest
	now = now.Add(45 * time.Second)
	if r.Contains("c") || r.Contains("d") || !r.Contains("b") {
		t.Fatalf("after expiry: %v", r.IDs())
	}
	if snap := r.Snapshot(); len(snap) != 1 || snap["b"] != 1030 {
		t.Fatalf("snapshot = %v", snap)
	}
	now = now.Add(time.Minute)
	if r.Len() != 0 {
		t.Fatalf("all expired, still %v", r.IDs())
	}
}

func TestNodeName(t *testing.T) {
	host, _ := os.Hostname()
	pid := strconv.Itoa(os.Getpid())
	for pattern, want := range map[string]string{
		"":               "onceler-" + pid + "@" + host,
		"w1":             "w1@" + host,
		"w1@box":         "w1@box",
		"w-%p@%h":        "w-" + pid + "@" + host,
		"w%%@%n":         "w%@" + strings.Split(host, ".")[0],
		"worker%i@x.%d!": "worker" + pid + "@x." + strings.Join(strings.Split(host, ".")[1:], ".") + "!",
	} {
		got, err := NodeName(pattern)
		if err != nil || got != want {
			t.Errorf("NodeName(%q) = %q, %v; want %q", pattern, got, err, want)
		}
	}
	for _, bad := range []string{"w%x", "@host"} {
		if _, err := NodeName(bad); err == nil {
			t.Errorf("NodeName(%q) accepted", bad)
		}
	}
}

func newUnitController(t *testing.T, cfg Config) *Controller {
	t.Helper()
	cfg.URL = "amqp://guest:secret@127.0.0.1:1/"
	if cfg.NodeName == "" {
		cfg.NodeName = "onceler-1@box"
	}
	c, err := New(newTestWorker(t, "", "", ""), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestSelected(t *testing.T) {
	c := newUnitController(t, Config{})
	for _, tc := range []struct {
		req  celeryproto.ControlRequest
		want bool
	}{
		{celeryproto.ControlRequest{}, true},
		{celeryproto.ControlRequest{Destination: []string{"other@box", "onceler-1@box"}}, true},
		{celeryproto.ControlRequest{Destination: []string{"other@box"}}, false},
		{celeryproto.ControlRequest{Destination: []string{"other@box"}, Pattern: "*", Matcher: "glob"}, false},
		{celeryproto.ControlRequest{Pattern: "onceler-*@box", Matcher: "glob"}, true},
		{celeryproto.ControlRequest{Pattern: "celery@*", Matcher: "glob"}, false},
		{celeryproto.ControlRequest{Pattern: `onceler-\d+`, Matcher: "pcre"}, true},
		{celeryproto.ControlRequest{Pattern: `box`, Matcher: "pcre"}, false}, // re.match anchors at the start
		{celeryproto.ControlRequest{Pattern: `x`, Matcher: "other"}, false},
	} {
		if got := c.selected(&tc.req); got != tc.want {
			t.Errorf("selected(%+v) = %v, want %v", tc.req, got, tc.want)
		}
	}
}

func TestDispatch(t *testing.T) {
	shut := 0
	c := newUnitController(t, Config{Shutdown: func() { shut++ }})
	w := c.worker().(*testWorker)
	res, after := c.dispatch(context.Background(), &celeryproto.ControlRequest{Method: "shutdown"})
	if !jsonEqual(res, ok("shutting down")) || after == nil {
		t.Fatalf("shutdown = %v", res)
	}
	after()
	if shut != 1 {
		t.Fatal("Shutdown not called")
	}
	if res, _ := c.dispatch(context.Background(), &celeryproto.ControlRequest{Method: "nope"}); !jsonEqual(res, nok(`unknown command "nope"`)) {
		t.Errorf("unknown = %v", res)
	}
	res, _ = c.dispatch(context.Background(), &celeryproto.ControlRequest{Method: "revoke", Arguments: map[string]any{"task_id": "x1"}})
	if !jsonEqual(res, ok("tasks x1 flagged as revoked")) || !w.revoked.Contains("x1") || !c.Revoked().Contains("x1") {
		t.Errorf("revoke = %v", res)
	}
	res, _ = c.dispatch(context.Background(), &celeryproto.ControlRequest{Method: "revoke", Arguments: map[string]any{"task_id": []any{"x2", "x3"}, "terminate": true}})
	if !jsonEqual(res, ok("terminate: tasks unknown")) || !w.revoked.Contains("x3") {
		t.Errorf("revoke terminate = %v", res)
	}
	if res, _ := c.dispatch(context.Background(), &celeryproto.ControlRequest{Method: "revoke"}); !jsonEqual(res, nok("revoke: no task_id given")) {
		t.Errorf("revoke without id = %v", res)
	}
	res, _ = c.dispatch(context.Background(), &celeryproto.ControlRequest{Method: "hello", Arguments: map[string]any{"from_node": "celery@py", "revoked": map[string]any{"y1": 1.0}}})
	hello, _ := res.(map[string]any)
	if rv, _ := hello["revoked"].(map[string]any); len(rv) != 4 || !w.revoked.Contains("y1") {
		t.Errorf("hello = %v", res)
	}
	if res, _ := c.dispatch(context.Background(), &celeryproto.ControlRequest{Method: "hello", Arguments: map[string]any{"from_node": "onceler-1@box"}}); res != nil {
		t.Errorf("hello from itself = %v", res)
	}
	if res, _ := c.dispatch(context.Background(), &celeryproto.ControlRequest{Method: "enable_events"}); !jsonEqual(res, ok("task events enabled")) || !c.TaskEvents() {
		t.Errorf("enable_events = %v", res)
	}
	if res, _ := c.dispatch(context.Background(), &celeryproto.ControlRequest{Method: "enable_events"}); !jsonEqual(res, ok("task events already enabled")) {
		t.Errorf("enable_events again = %v", res)
	}
	w.active["a1"] = &running{info: TaskInfo{ID: "a1", Name: "demo.add"}}
	w.reserved["r1"] = TaskInfo{ID: "r1", Name: "demo.add"}
	res, _ = c.dispatch(context.Background(), &celeryproto.ControlRequest{Method: "query_task", Arguments: map[string]any{"ids": []any{"a1", "r1", "zz"}}})
	if q, _ := res.(map[string]any); len(q) != 2 || q["a1"].([]any)[0] != "active" || q["r1"].([]any)[0] != "reserved" {
		t.Errorf("query_task = %v", res)
	}
	if conf, _ := c.dispatch(context.Background(), &celeryproto.ControlRequest{Method: "conf"}); strings.Contains(mustJSONAny(conf), "secret") {
		t.Errorf("conf leaks the password: %v", conf)
	}
	stats, _ := c.dispatch(context.Background(), &celeryproto.ControlRequest{Method: "stats"})
	if s := mustJSONAny(stats); strings.Contains(s, "secret") || !strings.Contains(s, "xxxxx") {
		t.Errorf("stats leak or miss the broker URL: %s", s)
	}
	c2 := newUnitController(t, Config{})
	if res, after := c2.dispatch(context.Background(), &celeryproto.ControlRequest{Method: "shutdown"}); after != nil || !jsonEqual(res, nok("shutdown is not enabled on this worker")) {
		t.Errorf("shutdown without Config.Shutdown = %v", res)
	}
}

func TestEventNeverBlocks(t *testing.T) {
	c := newUnitController(t, Config{EventBuffer: 4})
	ctx := context.Background()
	for i := 0; i < 10; i++ {
		c.Event(ctx, "task-received", map[string]any{"uuid": "u"})
	}
	if len(c.events) != 0 || c.dropped.Load() != 0 {
		t.Fatalf("task events off: queued %d dropped %d", len(c.events), c.dropped.Load())
	}
	c.SetTaskEvents(true)
	start := time.Now()
	for i := 0; i < 10; i++ {
		c.Event(ctx, "task-received", map[string]any{"uuid": "u"})
	}
	if len(c.events) != 4 || c.dropped.Load() != 6 || time.Since(start) > time.Second {
		t.Fatalf("queued %d dropped %d", len(c.events), c.dropped.Load())
	}
	ev := <-c.events
	if ev.stamp.Hostname != "onceler-1@box" || ev.stamp.Type != "task-received" || ev.stamp.Clock == 0 ||
		ev.stamp.PID != os.Getpid() || ev.stamp.Timestamp == 0 || ev.fields["uuid"] != "u" {
		t.Errorf("event = %+v", ev)
	}
	_, dropped, _ := c.Counters()
	if dropped != 6 {
		t.Errorf("Counters dropped = %d", dropped)
	}
}

func BenchmarkEvent(b *testing.B) {
	c, err := New(nil, Config{URL: "amqp://127.0.0.1:1/", NodeName: "n@h", TaskEvents: true, EventBuffer: 1 << 20})
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		c.Event(ctx, "task-succeeded", map[string]any{"uuid": "0b7c6a3e-1d1e-4a53-9a5c-3f8b1d2e4c5a", "result": "5", "runtime": 0.001})
		if len(c.events) == cap(c.events) {
			for len(c.events) > 0 {
				<-c.events
			}
		}
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
