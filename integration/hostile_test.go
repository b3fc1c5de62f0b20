package integration

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/internal/testkit"
)

// The hostile loads of docs/limits.md, published as bytes through a real
// AMQP client to a running `onceler worker --migrate` with a memory budget:
// the worker's peak resident memory (VmHWM) stays under the budget plus a
// fixed margin, each hostile message is quarantined or answered once (or,
// due later, not run), and a normal task is answered within seconds after
// each load.

const (
	hostileBudget = 256 << 20
	// hostileMargin covers the process itself (pools, connections, Go
	// runtime) and the collector's slack above the Go memory limit, which
	// the worker sets to the budget plus 64 MiB.
	hostileMargin = 256 << 20
	// hostileKill ends the worker should it grow far past the bound (a
	// regression), before it takes the machine's memory.
	hostileKill = 3 << 30
)

// procStatus reads a field of /proc/<pid>/status in bytes (VmHWM, VmRSS).
func procStatus(t *testing.T, pid int, field string) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatalf("read worker status: %v", err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == field+":" {
			kb, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil {
				t.Fatalf("%s: %v", field, err)
			}
			return kb << 10
		}
	}
	t.Fatalf("no %s in /proc/%d/status", field, pid)
	return 0
}

// freeAddr returns a local address nobody listens on.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// guardMemory kills the worker if its resident memory passes hostileKill.
func guardMemory(t *testing.T, w *replay.Worker) {
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Millisecond):
			}
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", w.PID()))
			if err != nil {
				return
			}
			for _, line := range strings.Split(string(b), "\n") {
				if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
					if kb, _ := strconv.ParseInt(f[1], 10, 64); kb<<10 > hostileKill {
						_ = syscall.Kill(w.PID(), syscall.SIGKILL)
						return
					}
				}
			}
		}
	}()
	t.Cleanup(func() { close(stop); <-done })
}

// msgpackEmptyMaps is a protocol 2 msgpack body of size bytes whose args
// are one-byte empty maps.
func msgpackEmptyMaps(size int) []byte {
	n := size - 8
	var b bytes.Buffer
	b.WriteByte(0x93) // [args, kwargs, embed]
	b.WriteByte(0xdd) // array 32
	_ = binary.Write(&b, binary.BigEndian, uint32(n))
	b.Write(bytes.Repeat([]byte{0x80}, n))
	b.WriteByte(0x80) // kwargs {}
	b.WriteByte(0xc0) // embed nil
	return b.Bytes()
}

// hostile is one load: its messages, and whether they are refused
// (quarantined and answered) or held for a later ETA (not run).
type hostile struct {
	name  string
	msgs  func(e *replay.Env) []*celeryproto.Publishing
	later bool
}

func rawTask(e *replay.Env, task, contentType string, body []byte, h map[string]any) *celeryproto.Publishing {
	id := testkit.NewID()
	headers := map[string]any{"lang": "py", "task": task, "id": id, "root_id": id}
	for k, v := range h {
		headers[k] = v
	}
	return &celeryproto.Publishing{ContentType: contentType, ContentEncoding: "binary", Headers: headers, Body: body,
		CorrelationID: id, ReplyTo: e.ReplyTo, DeliveryMode: 2}
}

func hostileLoads(t *testing.T) []hostile {
	maps := msgpackEmptyMaps(16<<20 - 64)
	enc, err := zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedBestCompression))
	if err != nil {
		t.Fatal(err)
	}
	bomb := enc.EncodeAll(maps, nil)
	_ = enc.Close()
	t.Logf("zstd bomb: %d bytes inflating to %d", len(bomb), len(maps))
	yaml := []byte("[[" + strings.Repeat("{a: 1},", (1<<20)/7-10) + "{}], {}, null]")
	return []hostile{
		{name: "8 zstd bombs of msgpack empty maps", msgs: func(e *replay.Env) []*celeryproto.Publishing {
			var out []*celeryproto.Publishing
			for range 8 {
				out = append(out, rawTask(e, demo.TaskAdd, celeryproto.ContentTypeMsgpack, bomb,
					map[string]any{"compression": celeryproto.CompressionZstd}))
			}
			return out
		}},
		{name: "16 uncompressed 16 MiB msgpack empty maps", msgs: func(e *replay.Env) []*celeryproto.Publishing {
			var out []*celeryproto.Publishing
			for range 16 {
				out = append(out, rawTask(e, demo.TaskAdd, celeryproto.ContentTypeMsgpack, maps, nil))
			}
			return out
		}},
		{name: "64 YAML bodies of 1 MiB", msgs: func(e *replay.Env) []*celeryproto.Publishing {
			var out []*celeryproto.Publishing
			for range 64 {
				out = append(out, rawTask(e, demo.TaskAdd, celeryproto.ContentTypeYAML, yaml, nil))
			}
			return out
		}},
		{name: "40 bodies of 48 MiB", msgs: func(e *replay.Env) []*celeryproto.Publishing {
			body := []byte(`[[1, 2], {"pad": "` + strings.Repeat("x", 48<<20) + `"}, {}]`)
			var out []*celeryproto.Publishing
			for range 40 {
				out = append(out, rawTask(e, demo.TaskAdd, celeryproto.ContentTypeJSON, body, nil))
			}
			return out
		}},
		{name: "120 messages of 4 MiB due in an hour", later: true, msgs: func(e *replay.Env) []*celeryproto.Publishing {
			eta := time.Now().Add(time.Hour).UTC().Format("2006-01-02T15:04:05.000000+00:00")
			body := []byte(`[[], {"message": "` + strings.Repeat("m", 4<<20) + `"}, {}]`)
			var out []*celeryproto.Publishing
			for range 120 {
				out = append(out, rawTask(e, demo.TaskFail, celeryproto.ContentTypeJSON, body, map[string]any{"eta": eta}))
			}
			return out
		}},
	}
}

func TestHostileMemoryLoads(t *testing.T) {
	e := demoEnv(t)
	w := e.StartWorker(replay.WorkerOptions{Concurrency: 4, Prefetch: 16,
		Env: []string{"ONCELER_MEMORY_BUDGET=" + strconv.Itoa(hostileBudget), "ONCELER_LOG_LEVEL=warn"}})
	guardMemory(t, w)
	ctx := context.Background()
	for _, load := range hostileLoads(t) {
		msgs := load.msgs(e)
		start := time.Now()
		for _, p := range msgs {
			if err := e.PublishRaw(ctx, "", e.Queue, p); err != nil {
				t.Fatalf("%s: publish: %v", load.name, err)
			}
		}
		ids := make([]string, len(msgs))
		for i, p := range msgs {
			ids[i] = p.CorrelationID
		}
		msgs = nil
		if load.later {
			// Held or sent back to the end of the queue: none runs; the
			// worker keeps going.
			time.Sleep(5 * time.Second)
			for _, id := range ids {
				if r := e.Replies(id); len(r) > 0 {
					t.Errorf("%s: a message due in an hour was answered: %v", load.name, r)
				}
			}
		} else {
			var quarantined []replay.Quarantined
			ok := testkit.Eventually(3*time.Minute, func() bool {
				q, err := e.TakeQuarantined()
				if err != nil {
					t.Fatalf("%s: quarantine: %v", load.name, err)
				}
				quarantined = append(quarantined, q...)
				return len(quarantined) >= len(ids)
			})
			if !ok {
				t.Fatalf("%s: %d of %d quarantined in 3 minutes", load.name, len(quarantined), len(ids))
			}
			for _, q := range quarantined {
				if q.Reason != "undecodable" && q.Reason != "bad_arguments" {
					t.Errorf("%s: quarantined as %s: %s", load.name, q.Reason, q.Detail)
				}
			}
			t.Logf("%s: quarantined as %s (%.120s) in %s", load.name, quarantined[0].Reason, quarantined[0].Detail, time.Since(start).Round(time.Millisecond))
			e.WaitReplies(ids, 1, 10*time.Second)
			for _, id := range ids {
				if r := e.Replies(id); len(r) != 1 || r[0].Status != "FAILURE" {
					t.Errorf("%s: answered %v, want one FAILURE", load.name, r)
					break
				}
			}
		}
		stillServing(t, e, w, load.name)
	}
}

// stillServing checks, after a hostile load named name, that worker w
// answers a normal task within seconds, lives, and has kept its peak
// memory under the budget plus the margin.
func stillServing(t *testing.T, e *replay.Env, w *replay.Worker, name string) {
	t.Helper()
	normal := e.Send(demo.TaskAdd, []any{1, 2}, nil)
	if !e.WaitReplies([]string{normal}, 1, 15*time.Second) {
		t.Errorf("%s: a normal task was not answered within 15 s after it", name)
	} else if r := e.Replies(normal); r[0].Status != "SUCCESS" {
		t.Errorf("%s: normal task answered %v", name, r)
	}
	if w.Exited() {
		t.Fatalf("%s: the worker died (%s)", name, w.State())
	}
	bound := int64(hostileBudget + hostileMargin)
	hwm := procStatus(t, w.PID(), "VmHWM")
	t.Logf("%s: peak RSS so far %d MiB (bound %d MiB)", name, hwm>>20, bound>>20)
	if hwm > bound {
		t.Errorf("%s: peak RSS %d MiB, above the budget plus margin %d MiB", name, hwm>>20, bound>>20)
	}
}

// TestReadyzWhileSlotsStuck: with every slot held by tasks that do not
// finish, /readyz answers 503 after --stall-after, and 200 again once they
// do.
func TestReadyzWhileSlotsStuck(t *testing.T) {
	e := demoEnv(t)
	addr := freeAddr(t)
	e.StartWorker(replay.WorkerOptions{Concurrency: 2, Prefetch: 4,
		Env: []string{"ONCELER_HTTP_ADDR=" + addr, "ONCELER_STALL_AFTER=2s"}})
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	status := func() int {
		resp, err := client.Get("http://" + addr + "/readyz")
		if err != nil {
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if !testkit.Eventually(10*time.Second, func() bool { return status() == http.StatusOK }) {
		t.Fatalf("/readyz %d at start, want 200", status())
	}
	ids := []string{
		e.Send(demo.TaskSleep, nil, map[string]any{"op": "stuck-" + testkit.NewID(), "seconds": 12}),
		e.Send(demo.TaskSleep, nil, map[string]any{"op": "stuck-" + testkit.NewID(), "seconds": 12}),
	}
	time.Sleep(time.Second)
	if s := status(); s != http.StatusOK {
		t.Errorf("/readyz %d as the slots fill, want 200 (not stalled yet)", s)
	}
	start := time.Now()
	if !testkit.Eventually(8*time.Second, func() bool { return status() == http.StatusServiceUnavailable }) {
		t.Fatalf("/readyz %d with both slots held for %s, want 503", status(), time.Since(start).Round(time.Second))
	}
	if !e.WaitReplies(ids, 1, 30*time.Second) {
		t.Fatal("the sleeps were not answered")
	}
	if !testkit.Eventually(5*time.Second, func() bool { return status() == http.StatusOK }) {
		t.Fatalf("/readyz %d after the tasks finished, want 200", status())
	}
}
