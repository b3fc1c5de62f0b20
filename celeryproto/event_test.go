package celeryproto

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/onceler/onceler/internal/testenv"
)

func TestEventRoutingKey(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"task-succeeded":   "task.succeeded",
		"worker-heartbeat": "worker.heartbeat",
		"task-multi":       "task.multi",
		"custom":           "custom",
	} {
		if got := EventRoutingKey(in); got != want {
			t.Errorf("EventRoutingKey(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestEncodeEventRefuses(t *testing.T) {
	t.Parallel()
	if _, err := EncodeEvent(map[string]any{"hostname": "a@b"}); err == nil {
		t.Error("event without type accepted")
	}
	if _, err := EncodeEvent(map[string]any{"type": "worker-online"}); err == nil {
		t.Error("event without hostname accepted")
	}
	if _, err := EncodeEvents(nil); err == nil {
		t.Error("empty event list accepted")
	}
}

func TestEncodeEventJSON(t *testing.T) {
	t.Parallel()
	ev := map[string]any{
		"type": "task-received", "hostname": "n@h", "s": "<a&b>\"\\\n\t\x01é\u2028\xff",
		"i": 3, "i64": int64(-4), "f": 2.0, "g": 0.25, "b": true, "nil": nil,
		"list": []any{"x", 1, []string{"y"}}, "m": map[string]any{"k": "v"},
		"t": time.Date(2026, 1, 2, 3, 4, 5, 6000, time.UTC), "u": uint64(9), "st": struct{ A int }{1},
	}
	p, err := EncodeEvent(ev)
	if err != nil {
		t.Fatal(err)
	}
	var got map[string]any
	if err := json.Unmarshal(p.Body, &got); err != nil {
		t.Fatalf("body %s: %v", p.Body, err)
	}
	std, _ := json.Marshal(ev)
	var want map[string]any
	_ = json.Unmarshal(std, &want)
	want["t"] = FormatTime(ev["t"].(time.Time))
	if gb, _ := json.Marshal(got); !bytes.Equal(gb, mustJSON(t, want)) {
		t.Fatalf("body decodes to %s, want %s", gb, mustJSON(t, want))
	}
	if !strings.Contains(string(p.Body), `"f":2.0`) {
		t.Errorf("integral float not written as a float: %s", p.Body)
	}
	if p.ContentType != "application/json" || p.ContentEncoding != "utf-8" || p.DeliveryMode != 1 || p.Headers["hostname"] != "n@h" {
		t.Errorf("publishing = %+v", p)
	}
	if _, err := EncodeEvent(map[string]any{"type": "x", "hostname": "y", "f": func() {}}); err == nil {
		t.Error("unencodable value accepted")
	}
}

func TestAppendEvent(t *testing.T) {
	t.Parallel()
	st := EventStamp{Type: "task-started", Hostname: "n@h", PID: 7, Clock: 9, Timestamp: 1700000000.5, UTCOffset: -1}
	b, err := AppendEvent([]byte("["), st, map[string]any{"uuid": "u1", "hostname": "other", "clock": 1, "extra": []any{1, "x"}})
	if err != nil {
		t.Fatal(err)
	}
	b = append(b, ']')
	var got []map[string]any
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatalf("%s: %v", b, err)
	}
	want := map[string]any{"type": "task-started", "hostname": "n@h", "pid": 7.0, "clock": 9.0, "utcoffset": -1.0,
		"timestamp": 1700000000.5, "uuid": "u1", "extra": []any{1.0, "x"}}
	if len(got) != 1 || string(mustJSON(t, got[0])) != string(mustJSON(t, want)) {
		t.Fatalf("AppendEvent = %s, want %s", b, mustJSON(t, want))
	}
	if _, err := AppendEvent(nil, EventStamp{Type: "x"}, nil); err == nil {
		t.Error("event without hostname accepted")
	}
	if out, err := AppendEvent([]byte("keep"), st, map[string]any{"bad": func() {}}); err == nil || string(out) != "keep" {
		t.Errorf("bad field: %q, %v", out, err)
	}
	p := EventPublishing("n@h", b)
	if p.Headers["hostname"] != "n@h" || p.DeliveryMode != 1 || p.ContentType != "application/json" {
		t.Errorf("EventPublishing = %+v", p)
	}
}

func BenchmarkAppendEvent(b *testing.B) {
	st := EventStamp{Type: "task-succeeded", Hostname: "onceler-1@host", PID: 1234, Clock: 99, Timestamp: 1.7e9}
	fields := map[string]any{"uuid": "0b7c6a3e-1d1e-4a53-9a5c-3f8b1d2e4c5a", "result": "'ok'", "runtime": 0.0012, "name": "demo.add"}
	buf := make([]byte, 0, 1024)
	b.ReportAllocs()
	for b.Loop() {
		var err error
		if buf, err = AppendEvent(buf[:0], st, fields); err != nil {
			b.Fatal(err)
		}
	}
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// celeryState feeds events to celery.events.state.State as
// celery.events.EventReceiver does (a list body is several events).
const celeryState = `
import base64, json, sys, time
from kombu.serialization import loads
from celery.events.state import State
st = State()
for line in sys.stdin:
    m = json.loads(line)
    body = loads(base64.b64decode(m['body']), m['content_type'], m['content_encoding'], accept={'application/json'})
    for ev in (body if isinstance(body, list) else [body]):
        ev['local_received'] = time.time()
        st.event(ev)
t = st.tasks.get('tid-1')
print(json.dumps({'alive': [w.hostname for w in st.alive_workers()],
                  'state': t and t.state, 'name': t and t.name, 'runtime': t and t.runtime,
                  'worker': t and t.worker and t.worker.hostname, 'dup': t and getattr(t, 'onceler_duplicate', None)}))
`

func TestEncodeEventCeleryState(t *testing.T) {
	t.Parallel()
	py := testenv.Python(t)
	now := float64(time.Now().UnixNano()) / 1e9
	base := func(typ string, extra map[string]any) map[string]any {
		m := map[string]any{"type": typ, "hostname": "onceler-1@h", "pid": 1, "clock": 1, "timestamp": now, "utcoffset": 0}
		for k, v := range extra {
			m[k] = v
		}
		return m
	}
	var in bytes.Buffer
	add := func(p *Publishing, err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		line, _ := json.Marshal(map[string]string{"body": base64.StdEncoding.EncodeToString(p.Body), "content_type": p.ContentType, "content_encoding": p.ContentEncoding})
		in.Write(append(line, '\n'))
	}
	add(EncodeEvent(base("worker-online", map[string]any{"freq": 2.0, "active": 0, "processed": 0, "loadavg": []any{0.1, 0.2, 0.3}, "sw_ident": "onceler", "sw_ver": "0", "sw_sys": "Linux"})))
	add(EncodeEvents([]map[string]any{
		base("task-received", map[string]any{"uuid": "tid-1", "name": "demo.add", "args": "(1, 2)", "kwargs": "{}", "retries": 0, "eta": nil, "expires": nil, "root_id": "tid-1", "parent_id": nil}),
		base("task-started", map[string]any{"uuid": "tid-1"}),
		base("task-succeeded", map[string]any{"uuid": "tid-1", "result": "3", "runtime": 0.01, "onceler_duplicate": true}),
	}))
	add(EncodeEvent(base("worker-heartbeat", map[string]any{"freq": 2.0, "active": 0, "processed": 1})))
	cmd := exec.Command(py, "-c", celeryState)
	cmd.Stdin = &in
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("celery state: %v\n%s", err, out)
	}
	var got struct {
		Alive   []string
		State   string
		Name    string
		Runtime float64
		Worker  string
		Dup     bool
	}
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatalf("%s: %v", out, err)
	}
	if len(got.Alive) != 1 || got.Alive[0] != "onceler-1@h" {
		t.Errorf("alive workers = %v", got.Alive)
	}
	if got.State != "SUCCESS" || got.Name != "demo.add" || got.Runtime != 0.01 || got.Worker != "onceler-1@h" || !got.Dup {
		t.Errorf("task as Celery sees it = %+v", got)
	}
}

func BenchmarkEncodeEvent(b *testing.B) {
	ev := map[string]any{"type": "task-succeeded", "hostname": "onceler-1@host", "pid": 1234, "clock": int64(99),
		"timestamp": 1.7e9, "utcoffset": 0, "uuid": "0b7c6a3e-1d1e-4a53-9a5c-3f8b1d2e4c5a", "result": "'ok'", "runtime": 0.0012}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := EncodeEvent(ev); err != nil {
			b.Fatal(err)
		}
	}
}
