package control

import (
	"context"
	"os"
	"testing"
	"time"
)

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
