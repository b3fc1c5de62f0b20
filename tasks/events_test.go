package tasks

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceler/onceler/celeryproto"
)

// gatedRecorder is an Observer with control.Controller's TaskEvents switch.
type gatedRecorder struct {
	recorder
	on    atomic.Bool
	asked atomic.Int32
}

func (g *gatedRecorder) TaskEvents() bool { g.asked.Add(1); return g.on.Load() }

// TestTaskEventFields: with task events off the Observer gets nothing (no
// field maps are built); on, task-succeeded carries runtime (float seconds)
// and result (a Python repr), task-failed exception and a string traceback.
func TestTaskEventFields(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	rec := &gatedRecorder{}
	cfg := e.config()
	cfg.Observer, cfg.Concurrency = rec, 1
	reg := testRegistry(t, &effects{})
	if err := Register(reg, Task[addArgs]{Name: "t.map", Run: func(context.Context, *Call, addArgs) (any, error) {
		return map[string]any{"ok": true, "n": nil, "s": "it's"}, nil
	}}); err != nil {
		t.Fatal(err)
	}
	e.start(reg, cfg)
	e.python(2, "json", pyCall{Task: "t.add", Args: []any{1, 2}})
	rec.mu.Lock()
	n := len(rec.events)
	rec.mu.Unlock()
	if n != 0 || rec.asked.Load() == 0 {
		t.Fatalf("events off: %d events, TaskEvents asked %d times", n, rec.asked.Load())
	}
	rec.on.Store(true)
	res := e.python(2, "json",
		pyCall{Task: "t.add", Args: []any{1, 2}},
		pyCall{Task: "t.map", Args: []any{1, 2}},
		pyCall{Task: "t.fail_value", Args: []any{1, 2}},
	)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	byType := map[string]map[string]any{}
	for _, ev := range rec.events {
		byType[fmt.Sprint(ev["type"], ":", ev["uuid"])] = ev
	}
	for i, want := range []string{"3", `{'n': None, 'ok': True, 's': "it's"}`} {
		ev := byType["task-succeeded:"+res[i].ID]
		if ev == nil {
			t.Fatalf("no task-succeeded for call %d in %v", i, rec.events)
		}
		if rt, ok := ev["runtime"].(float64); !ok || rt < 0 || rt > 5 {
			t.Errorf("runtime %#v, want float seconds", ev["runtime"])
		}
		if ev["result"] != want {
			t.Errorf("result %#v, want %q", ev["result"], want)
		}
	}
	ev := byType["task-failed:"+res[2].ID]
	if ev == nil {
		t.Fatalf("no task-failed in %v", rec.events)
	}
	tb, ok := ev["traceback"].(string)
	if ev["exception"] != "ValueError('x must be positive')" || !ok || !strings.Contains(tb, "t.fail_value") ||
		!strings.HasSuffix(tb, "ValueError: x must be positive\n") {
		t.Errorf("task-failed exception %#v traceback %#v", ev["exception"], ev["traceback"])
	}
}

func TestResultRepr(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		`null`: "None", `1.5`: "1.5", `2`: "2", `"a'b"`: `"a'b"`, `"a'\"b"`: `'a\'"b'`, `[1,"x\n"]`: `[1, 'x\n']`,
		`{"b":false,"a":[]}`: `{'a': [], 'b': False}`, `1e300`: "1e+300",
	} {
		if got := resultRepr([]byte(in)); got != want {
			t.Errorf("repr(%s) = %s, want %s", in, got, want)
		}
	}
	if got := resultRepr([]byte(`"` + strings.Repeat("x", 3000) + `"`)); len(got) != 1024 || !strings.HasSuffix(got, "...") {
		t.Errorf("long repr: %d bytes", len(got))
	}
}

type recorder struct {
	mu     sync.Mutex
	events []map[string]any
}

func (r *recorder) Event(_ context.Context, typ string, fields map[string]any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	fields["type"] = typ
	r.events = append(r.events, fields)
}

// TestEventsOfRefusedMessages: as from Celery's worker, an unknown task
// gives task-failed NotRegistered('name') and no task-received, bad
// arguments task-received then task-failed TypeError, and an expired
// message task-revoked alone.
func TestEventsOfRefusedMessages(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	rec := &recorder{}
	cfg := e.config()
	cfg.Observer = rec
	e.start(testRegistry(t, &effects{}), cfg)
	replyTo, replies := e.replyQueue()
	e.publish(&celeryproto.Message{Protocol: 2, Task: "t.nope", ID: taskID(1), ReplyTo: replyTo, CorrelationID: taskID(1)})
	e.publish(&celeryproto.Message{Protocol: 2, Task: "t.add", ID: taskID(2), Args: []any{"x", 1}, ReplyTo: replyTo, CorrelationID: taskID(2)})
	gone := &celeryproto.Message{Protocol: 2, Task: "t.add", ID: taskID(3), Args: []any{int64(1), int64(2)}, ReplyTo: replyTo, CorrelationID: taskID(3)}
	gone.Expires = time.Now().Add(-time.Minute)
	e.publish(gone)
	results(t, replies, 3, 10*time.Second)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	got := map[string][]string{}
	for _, ev := range rec.events {
		id := fmt.Sprint(ev["uuid"])
		s := fmt.Sprint(ev["type"])
		if ev["type"] == "task-failed" {
			s += " " + fmt.Sprint(ev["exception"])
		}
		got[id] = append(got[id], s)
	}
	for id, want := range map[string][]string{
		taskID(1): {"task-failed NotRegistered('t.nope')"},
		taskID(2): {"task-received", "task-failed TypeError('bad arguments for t.add: argument x: expected int64, got str')"},
		taskID(3): {"task-revoked"},
	} {
		if fmt.Sprint(got[id]) != fmt.Sprint(want) {
			t.Errorf("%s: events %q, want %q", id, got[id], want)
		}
	}
}

// TestObserverEvents: the Observer sees Celery's task events with their
// fields, a duplicate marked onceler_duplicate, and never argument values
// beyond Celery's own reprs or the operation key itself.
func TestObserverEvents(t *testing.T) {
	e := newEnv(t)
	rec := &recorder{}
	cfg := e.config()
	cfg.Observer, cfg.Concurrency = rec, 1
	e.start(testRegistry(t, &effects{}), cfg)
	res := e.python(2, "json",
		pyCall{Task: "t.pay", Kwargs: map[string]any{"order_id": "ev-1", "amount": 3}},
		pyCall{Task: "t.pay", Kwargs: map[string]any{"order_id": "ev-1", "amount": 3}},
		pyCall{Task: "t.fail_value", Args: []any{1, 2}},
	)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	var got []string
	for _, ev := range rec.events {
		s := fmt.Sprintf("%s:%s", ev["type"], ev["uuid"])
		if ev["onceler_duplicate"] == true {
			s += ":dup"
		}
		got = append(got, s)
		if ev["type"] == "task-received" && (ev["kwargs"] == nil || ev["name"] == nil || ev["retries"] == nil) {
			t.Errorf("task-received fields: %v", ev)
		}
		for k, v := range ev {
			if fmt.Sprint(v) == "ev-1" {
				t.Errorf("event %s field %s carries the operation key", ev["type"], k)
			}
		}
	}
	// task-received goes when a message arrives (before a slot is free):
	// each task's own events are in order, and the tasks run in order.
	want := map[string][]string{
		res[0].ID: {"task-received:" + res[0].ID, "task-started:" + res[0].ID, "task-succeeded:" + res[0].ID},
		res[1].ID: {"task-received:" + res[1].ID, "task-succeeded:" + res[1].ID + ":dup"},
		res[2].ID: {"task-received:" + res[2].ID, "task-started:" + res[2].ID, "task-failed:" + res[2].ID},
	}
	byID := map[string][]string{}
	var ends []string
	for _, s := range got {
		id := strings.SplitN(s, ":", 3)[1]
		byID[id] = append(byID[id], s)
		if !strings.HasPrefix(s, "task-received:") && !strings.HasPrefix(s, "task-started:") {
			ends = append(ends, id)
		}
	}
	for id, w := range want {
		if fmt.Sprint(byID[id]) != fmt.Sprint(w) {
			t.Errorf("events of %s\n got %v\nwant %v (all: %v)", id, byID[id], w, got)
		}
	}
	if fmt.Sprint(ends) != fmt.Sprint([]string{res[0].ID, res[1].ID, res[2].ID}) || len(got) != 8 {
		t.Errorf("events %v: tasks not answered in order", got)
	}
}
