package control

import (
	"context"
	"strings"
	"testing"

	"github.com/onceler/onceler/celeryproto"
)

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
