package celeryproto

import (
	"encoding/json"
	"reflect"
	"testing"
)

// AppendTaskEvent writes what AppendEvent writes for the map Fields
// returns, for every task event type: a reader cannot tell the two apart.
func TestAppendTaskEventMatchesFields(t *testing.T) {
	t.Parallel()
	stamp := EventStamp{Hostname: "onceler-1@host", PID: 4242, Clock: 17, Timestamp: 1764500000.123456, UTCOffset: -1}
	events := []TaskEvent{
		{Type: "task-received", UUID: "9b1d-…", Name: "demo.add", Args: "(2, 3)", Kwargs: "{'note': \"it's <ok> & \\\"fine\\\"\"}",
			RootID: "root-1", Retries: 2, ETA: "2026-11-30T12:00:00.000000+00:00"},
		{Type: "task-received", UUID: "u2", Name: "demo.add", Args: "()", Kwargs: "{}", Expires: "2026-11-30T13:00:00+00:00"},
		{Type: "task-started", UUID: "u3", KeyHash: "0123456789abcdef"},
		{Type: "task-succeeded", UUID: "u4", Result: "{'ok': True, 'line': '\\u2028\\n'}", Runtime: 0.0125},
		{Type: "task-succeeded", UUID: "u5", Result: "None", Duplicate: true, KeyHash: "fedcba9876543210"},
		{Type: "task-failed", UUID: "u6", Exception: "ValueError('bad\\ninput')", Traceback: "Traceback (most recent call last):\n  onceler Go task 'demo.x'\nValueError: bad\n"},
		{Type: "task-retried", UUID: "u7", Exception: "GatewayTimeout('x')", Traceback: "t"},
		{Type: "task-revoked", UUID: "u8", Terminated: true, Signum: 15},
		{Type: "task-revoked", UUID: "u9", Expired: true},
		{Type: "task-rejected", UUID: "u10", Name: "no.such.task"},
	}
	for _, e := range events {
		got, err := AppendTaskEvent(nil, stamp, &e)
		if err != nil {
			t.Fatalf("%s: %v", e.Type, err)
		}
		s := stamp
		s.Type = e.Type
		want, err := AppendEvent(nil, s, e.Fields())
		if err != nil {
			t.Fatalf("%s: map: %v", e.Type, err)
		}
		var g, w map[string]any
		if err := json.Unmarshal(got, &g); err != nil {
			t.Fatalf("%s: %s is not JSON: %v", e.Type, got, err)
		}
		if err := json.Unmarshal(want, &w); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(g, w) {
			t.Errorf("%s:\n got %s\nwant %s", e.Type, got, want)
		}
		if g["type"] != e.Type || g["hostname"] != stamp.Hostname || g["uuid"] != e.UUID {
			t.Errorf("%s: stamp or uuid missing: %s", e.Type, got)
		}
	}
}

func BenchmarkTaskEventEncoding(b *testing.B) {
	stamp := EventStamp{Hostname: "onceler-1@host", PID: 4242, Clock: 17, Timestamp: 1764500000.123456}
	received := TaskEvent{Type: "task-received", UUID: "0b7c6a3e-1d1e-4a53-9a5c-3f8b1d2e4c5a", Name: "demo.add",
		Args: "('op-1',)", Kwargs: "{}", RootID: "0b7c6a3e-1d1e-4a53-9a5c-3f8b1d2e4c5a"}
	buf := make([]byte, 0, 1024)
	b.Run("struct", func(b *testing.B) {
		for range b.N {
			e := received
			buf, _ = AppendTaskEvent(buf[:0], stamp, &e)
		}
	})
	b.Run("map", func(b *testing.B) {
		s := stamp
		s.Type = received.Type
		for range b.N {
			buf, _ = AppendEvent(buf[:0], s, received.Fields())
		}
	})
}
