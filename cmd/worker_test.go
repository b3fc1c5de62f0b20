package cmd

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/internal/testenv"
)

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	return addr
}

func httpGet(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer func() { _ = resp.Body.Close() }()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// inspectPy asks one node, as "celery inspect" does, for ping, registered,
// conf and stats.
const inspectPy = `
import json, os, sys
from celery import Celery
app = Celery("inspect", broker=os.environ["ONCELER_BROKER_URL"])
i = app.control.inspect(destination=[sys.argv[1]], timeout=3)
print(json.dumps({"ping": i.ping(), "registered": i.registered(), "conf": i.conf(), "stats": i.stats()}))
`

// TestWorkerServesMetricsAndHealth checks /healthz, /readyz and /metrics of
// a running worker, with counters that moved for a task it ran, and that it
// answers Celery's remote control under its --hostname.
func TestWorkerServesMetricsAndHealth(t *testing.T) {
	t.Parallel()
	s := newStack(t)
	addr := freeAddr(t)
	name := testenv.Name("w")
	w := startWorker(t, s.env, "--http-addr", addr, "--hostname", name+"@%h", "--events")
	base := "http://" + addr
	if code, body := httpGet(t, base+"/healthz"); code != 200 || body != "ok\n" {
		t.Fatalf("/healthz: %d %q", code, body)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		code, _ := httpGet(t, base+"/readyz")
		if code == 200 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("/readyz still %d", code)
		}
		time.Sleep(100 * time.Millisecond)
	}
	key := testenv.Name("e")
	_, replies := s.sendTasks(t, 60*time.Second, call{demo.TaskCredit, []any{key, key, 7}}, call{demo.TaskCredit, []any{key, key, 7}}).replies(90 * time.Second)
	if len(replies) != 2 || replies[0].Error != "" || replies[1].Error != "" {
		t.Fatalf("replies %+v", replies)
	}
	host, _ := os.Hostname()
	node := name + "@" + host
	got := celeryInspect(t, s.env, node)
	if fmt.Sprint(got["ping"][node]) != "map[ok:pong]" || !strings.Contains(fmt.Sprint(got["registered"][node]), "demo.ledger.credit") {
		t.Fatalf("celery inspect ping/registered of %s: %v", node, got)
	}
	// conf and stats give the concurrency the worker runs with (its
	// default here), not the unset flag's 0.
	conf, _ := got["conf"][node].(map[string]any)
	stats, _ := got["stats"][node].(map[string]any)
	pool, _ := stats["pool"].(map[string]any)
	if c := conf["worker_concurrency"]; c == float64(0) || c == nil || fmt.Sprint(c) != fmt.Sprint(pool["max-concurrency"]) {
		t.Errorf("inspect conf worker_concurrency %v, stats pool max-concurrency %v", c, pool["max-concurrency"])
	}
	_, metrics := httpGet(t, base+"/metrics")
	for _, want := range []string{
		`onceler_tasks_received_total{task="demo.ledger.credit"} 2`,
		// One ran; the second delivery of the same operation was answered
		// from the record.
		`onceler_tasks_succeeded_total{task="demo.ledger.credit"} 1` + "\n",
		`onceler_duplicates_suppressed_total{task="demo.ledger.credit"} 1` + "\n",
		"go_goroutines",
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics misses %q", want)
		}
	}
	w.stop()
}

// TestWorkerGracefulShutdown stops a worker with SIGTERM while a task runs:
// the task finishes within the grace period, the caller gets its result, the
// process exits 0. With a grace period shorter than the task, the task is
// cancelled, its message goes back to the queue, and the next worker runs it
// once.
func TestWorkerGracefulShutdown(t *testing.T) {
	s := newStack(t)
	ctx := context.Background()
	pool := testenv.Pool(t)

	op := testenv.Name("op")
	w := startWorker(t, s.env)
	sender := s.sendTasks(t, 60*time.Second, call{demo.TaskSleep, []any{op, 2}})
	w.waitLog("sleep started", 60*time.Second)
	w.stop()
	if !strings.Contains(w.stderr.String(), "worker stopped") {
		t.Fatalf("no clean stop:\n%s", w.stderr.String())
	}
	_, replies := sender.replies(60 * time.Second)
	if len(replies) != 1 || replies[0].Error != "" {
		t.Fatalf("reply %+v", replies)
	}
	n, err := demo.CountSleeps(ctx, pool, op)
	wantCount(t, "sleeps", n, err, 1)

	op = testenv.Name("op")
	w = startWorker(t, s.env, "--grace", "500ms")
	sender = s.sendTasks(t, 90*time.Second, call{demo.TaskSleep, []any{op, 3}})
	w.waitLog("sleep started", 60*time.Second)
	w.stop()
	if n, _ := demo.CountSleeps(ctx, pool, op); n != 0 {
		t.Fatalf("a task cut by the grace period left its effect (%d)", n)
	}
	w = startWorker(t, s.env)
	_, replies = sender.replies(90 * time.Second)
	w.stop()
	if len(replies) != 1 || replies[0].Error != "" {
		t.Fatalf("reply after redelivery %+v", replies)
	}
	n, err = demo.CountSleeps(ctx, pool, op)
	wantCount(t, "sleeps", n, err, 1)
}

// TestWorkerQuorumQueues starts a worker with --quorum, which declares the
// missing queue as a quorum queue, sends it a task, then shows that a
// worker started without --quorum serves the quorum queue as it is
// (per-consumer prefetch: global QoS would be refused).
func TestWorkerQuorumQueues(t *testing.T) {
	t.Parallel()
	s := newStack(t)
	w := startWorker(t, s.env, "--quorum")
	w.waitLog(`"queue":"`+s.queue+`","arguments":{"x-queue-type":"quorum"}`, 10*time.Second)
	_, replies := s.sendQuorumTask(t, call{demo.TaskAdd, []any{20, 22}}).replies(90 * time.Second)
	w.stop()
	if len(replies) != 1 || fmt.Sprint(replies[0].OK) != "42" {
		t.Fatalf("replies %+v", replies)
	}
	w = startWorker(t, s.env)
	w.waitLog(`"global_qos":false`, 10*time.Second)
	_, replies = s.sendQuorumTask(t, call{demo.TaskAdd, []any{1, 1}}).replies(90 * time.Second)
	w.stop()
	if len(replies) != 1 || fmt.Sprint(replies[0].OK) != "2" {
		t.Fatalf("replies of the worker without --quorum %+v", replies)
	}
}

// quorumSendPy sends one task to a quorum queue declared as kombu does.
const quorumSendPy = `
import json, os, sys
from celery import Celery
from kombu import Queue
queue, name, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
app = Celery("sender", broker=os.environ["ONCELER_BROKER_URL"], backend="rpc://")
app.conf.task_queues = [Queue(queue, queue_arguments={"x-queue-type": "quorum"})]
r = app.send_task(name, args=args, queue=queue)
print(json.dumps({"id": r.id}), flush=True)
try:
    print(json.dumps({"ok": r.get(timeout=60)}), flush=True)
except Exception as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e)}), flush=True)
`

func (s *stack) sendQuorumTask(t *testing.T, c call) *proc {
	t.Helper()
	b, _ := json.Marshal(c.Args)
	return start(t, "python quorum sender", s.env, testenv.Python(t), "-c", quorumSendPy, s.queue, c.Task, string(b))
}

func TestParseSize(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]int64{"256MiB": 256 << 20, "2GiB": 2 << 30, "512Mi": 512 << 20, "1.5GiB": 3 << 29,
		"100MB": 100e6, "1048576": 1 << 20, " 64 MiB ": 64 << 20} {
		if got, err := parseSize(in); err != nil || got != want {
			t.Errorf("parseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "MiB", "12XB", "-5MiB", "0"} {
		if _, err := parseSize(in); err == nil {
			t.Errorf("parseSize(%q) accepted", in)
		}
	}
}
