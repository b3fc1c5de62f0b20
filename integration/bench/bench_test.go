package main

import (
	"encoding/json"
	"maps"
	"os"
	"os/exec"
	"slices"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/onceler/onceler/celeryproto"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestMessagesAsCelerySends checks the pre-filled messages against the
// golden vector captured from Celery 5.2.6: the same header names, the same
// properties, and a body Celery's format decodes to the bench task.
func TestMessagesAsCelerySends(t *testing.T) {
	raw, err := os.ReadFile("../../celeryproto/testdata/golden/p2_json_basic.json")
	if err != nil {
		t.Fatal(err)
	}
	var golden struct {
		Headers    map[string]any `json:"headers"`
		Properties map[string]any `json:"properties"`
	}
	if err := json.Unmarshal(raw, &golden); err != nil {
		t.Fatal(err)
	}
	msgs, ops, err := msgSpec{Task: taskOutside, N: 3, RunID: "t", ReplyTo: "reply-q"}.build()
	if err != nil {
		t.Fatal(err)
	}
	for i, p := range msgs {
		if got, want := slices.Sorted(maps.Keys(p.Headers)), slices.Sorted(maps.Keys(golden.Headers)); !slices.Equal(got, want) {
			t.Fatalf("headers %v, Celery sends %v", got, want)
		}
		if p.ContentType != golden.Properties["content_type"] || p.ContentEncoding != golden.Properties["content_encoding"] ||
			float64(p.DeliveryMode) != golden.Properties["delivery_mode"] || p.CorrelationID != p.Headers["id"] {
			t.Fatalf("properties %+v, Celery sends %v", p, golden.Properties)
		}
		m, err := celeryproto.Decode(&celeryproto.Delivery{ContentType: p.ContentType, ContentEncoding: p.ContentEncoding,
			Headers: p.Headers, Body: p.Body, CorrelationID: p.CorrelationID, ReplyTo: p.ReplyTo, DeliveryMode: p.DeliveryMode})
		if err != nil {
			t.Fatal(err)
		}
		if m.Protocol != 2 || m.Task != taskOutside || len(m.Args) != 1 || m.Args[0] != ops[i] || m.ReplyTo != "reply-q" ||
			m.RootID != m.ID || m.IgnoreResult {
			t.Fatalf("decoded %+v", m)
		}
	}
}

// TestDuplicatePattern: every DupEvery-th operation repeats the one DupGap
// messages earlier, so that (d) has the asked share of duplicates, each sent
// well after its original was answered.
func TestDuplicatePattern(t *testing.T) {
	s := msgSpec{N: 5000, RunID: "r", DupEvery: 5, DupGap: 1024}
	ops := s.ops()
	distinct := map[string]bool{}
	for i, op := range ops {
		if s.DupEvery > 0 && i%5 == 4 && i >= 1024 {
			if op != ops[i-1024] {
				t.Fatalf("message %d: %q, want a repeat of message %d", i, op, i-1024)
			}
		}
		distinct[op] = true
	}
	dups := len(ops) - len(distinct)
	if want := (5000 - 1024) / 5; dups < want-1 || dups > want+1 {
		t.Fatalf("%d duplicates, want about %d", dups, want)
	}
	if got := len((msgSpec{N: 100, RunID: "r"}).ops()); got != 100 {
		t.Fatalf("%d ops", got)
	}
}

func TestPercentile(t *testing.T) {
	d := make([]time.Duration, 100)
	for i := range d {
		d[i] = time.Duration(100-i) * time.Millisecond
	}
	sortDurations(d)
	if p := percentile(d, 0.5); p != 50*time.Millisecond {
		t.Fatalf("p50 %v", p)
	}
	if p := percentile(d, 0.99); p != 99*time.Millisecond {
		t.Fatalf("p99 %v", p)
	}
	if p := percentile(nil, 0.99); p != 0 {
		t.Fatalf("empty p99 %v", p)
	}
}

// TestSpawnWatch: a process started with the mark in its command line is
// seen, one without it is not.
func TestSpawnWatch(t *testing.T) {
	if _, ok := lastPID(); !ok {
		t.Skip("no /proc/loadavg")
	}
	w := watchSpawns("spawnwatch-test-mark")
	if err := exec.Command("sh", "-c", "sleep 0.05", "other-name").Run(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond)
	if n := w.Stop(); n != 0 {
		t.Fatalf("saw %d marked processes, started none", n)
	}
	w = watchSpawns("spawnwatch-test-mark")
	if err := exec.Command("sh", "-c", "sleep 0.05", "spawnwatch-test-mark-1").Run(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond)
	// sh may fork for the sleep: its child has the mark for a moment too.
	if n := w.Stop(); n < 1 {
		t.Fatalf("saw %d marked processes, started 1", n)
	}
}
