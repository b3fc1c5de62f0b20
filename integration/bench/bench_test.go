package main

import (
	"encoding/json"
	"maps"
	"os"
	"os/exec"
	"slices"
	"strings"
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

// TestTargets checks the verdicts of the report's targets: a ratio under
// its bound is MISSED, a scenario not run is "not measured", and the p99 at
// half the drain rate follows its scenario's half-load check, with no
// verdict of its own.
func TestTargets(t *testing.T) {
	msec := time.Millisecond
	worker := func(id string, rate float64, p99 time.Duration) row {
		return row{sc: scenario{ID: id, Kind: "worker"}, rate: rate, rssKiB: 50 * 1024, commits: 0.03,
			lat: latStats{n: 100, p99: p99}, latRate: rate / 4, sustained: rate / 2,
			halfDrain: latStats{n: 100, p99: 3 * p99, busy: 0.86}}
	}
	rows := []row{
		{sc: scenario{ID: "a", Kind: "raw"}, rate: 10000},
		worker("b", 8000, 17*msec),
		worker("b'", 4000, 25*msec),
		worker("c", 5000, 18*msec),
		{sc: scenario{ID: "e", Kind: "python"}, rate: 1000},
		{sc: scenario{ID: "b'-hot", Kind: "worker"}, rate: 3000, drainError: os.ErrDeadlineExceeded},
	}
	got := strings.Split(strings.TrimSpace(targets(rows)), "\n")
	want := []string{
		"- (b) ≥ 60% of (a): met (80%)",
		"- (b) ≥ 10× (e): MISSED (8.0×)",
		"- (b') ≥ 45% of (a): MISSED (40%)",
		"- (c) ≥ 45% of (a): met (50%)",
		"- (b'-hot) ≥ 20% of (a): not measured (0%)",
		"- (b) p99 at half load (half the sustained rate) ≤ 20 ms: met (17.0 ms at 2000/s, half the 4000/s sustained)",
		"- (b) p99 at half the drain rate (4000/s, CPU 86% busy): 51.0 ms (measured, no target)",
		"- (b') p99 at half load (half the sustained rate) ≤ 20 ms: MISSED (25.0 ms at 1000/s, half the 2000/s sustained)",
		"- (b') p99 at half the drain rate (2000/s, CPU 86% busy): 75.0 ms (measured, no target)",
		"- (c) p99 at half load (half the sustained rate) ≤ 20 ms: met (18.0 ms at 1250/s, half the 2500/s sustained)",
		"- (c) p99 at half the drain rate (2500/s, CPU 86% busy): 54.0 ms (measured, no target)",
		"- worker peak RSS ≤ 100 MiB (every worker scenario): met (50.0 MiB)",
		"- (b) PostgreSQL commits per task ≤ 0.1: met (0.030)",
	}
	for i, w := range want {
		if i >= len(got) {
			t.Fatalf("targets has %d lines, want at least %d:\n%s", len(got), len(want)+1, strings.Join(got, "\n"))
		}
		if got[i] != w {
			t.Errorf("targets line %d:\n got %q\nwant %q", i, got[i], w)
		}
	}
	if last := got[len(got)-1]; !strings.HasPrefix(last, "- (f) events and remote control cost < 5% of (b)'s throughput: not measured") {
		t.Errorf("last line %q: (f) was not run", last)
	}
}
