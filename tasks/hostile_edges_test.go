package tasks

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// Hostile input at the edges of the memory budget and the broker's
// answers: ordinary messages must still run, and nothing may loop.

// TestXZMessageRunsUnderSmallBudget: a small, ordinary task message that a
// Celery producer compressed with lzma (task_compression="lzma", kombu's
// header "application/x-lzma") runs under a memory budget of 128 MiB, the
// default on a machine or container of 512 MiB: its estimate counts the
// dictionary and the size the body declares, not the largest allowed.
func TestXZMessageRunsUnderSmallBudget(t *testing.T) {
	e := newEnv(t)
	release := make(chan struct{})
	close(release)
	started := make(chan string, 10)
	cfg := e.config()
	cfg.MemoryBudget = 128 << 20
	e.start(blockRegistry(t, release, started), cfg)
	replyTo, replies := e.replyQueue()
	id := taskID(1)
	p, err := celeryproto.EncodeTask(&celeryproto.Message{Task: "t.block", ID: id, Kwargs: map[string]any{"pad": "x"},
		ReplyTo: replyTo}, celeryproto.EncodeOptions{Compression: "lzma"})
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Body) > 1024 {
		t.Fatalf("compressed body of %d bytes, want a small one", len(p.Body))
	}
	e.publishRaw(p)
	r := results(t, replies, 1, 15*time.Second)[id]
	if len(r) != 1 || r[0]["status"] != "SUCCESS" {
		var why []string
		for _, q := range e.quarantined() {
			why = append(why, fmt.Sprintf("%v: %v", q.Headers[HeaderReason], q.Headers[HeaderDecodeReason]))
		}
		t.Fatalf("a %d-byte lzma message under a 128 MiB budget answered %v (quarantined: %v), want one SUCCESS",
			len(p.Body), r, why)
	}
}

// TestDueTaskNotStarvedByHeldETA: deliveries held for their ETA take up
// to half the budget; a task due now that needs more than the other half
// before decoding (an lzma-compressed one, estimated near 160 MiB under a
// 256 MiB budget) gets it: the held deliveries due latest go back to their
// queue to make room, and the tasks due now run within seconds.
func TestDueTaskNotStarvedByHeldETA(t *testing.T) {
	e := newEnv(t)
	release := make(chan struct{})
	close(release)
	started := make(chan string, 100)
	cfg := e.config()
	cfg.Concurrency, cfg.Prefetch = 2, 40
	cfg.MemoryBudget = 256 << 20
	r := e.start(blockRegistry(t, release, started), cfg)
	w := r.w
	later := time.Now().Add(time.Hour)
	const n = 28 // about 4 MiB each once decoded: 112 MiB, under half the budget
	for i := range n {
		e.publishBlock(taskID(i), 2<<20, "", later)
	}
	testkit.WaitFor(t, "ETA deliveries held", 20*time.Second, func() bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		return len(w.held) == n
	})
	replyTo, replies := e.replyQueue()
	id := taskID(100)
	p, err := celeryproto.EncodeTask(&celeryproto.Message{Task: "t.block", ID: id, Kwargs: map[string]any{"pad": "x"},
		ReplyTo: replyTo}, celeryproto.EncodeOptions{Compression: "lzma"})
	if err != nil {
		t.Fatal(err)
	}
	e.publishRaw(p)
	plain := taskID(101)
	e.publishBlock(plain, 10, replyTo, time.Time{})
	got := map[string][]map[string]any{}
	deadline := time.After(15 * time.Second)
	for len(got) < 2 {
		select {
		case m := <-replies:
			id, _ := m["task_id"].(string)
			got[id] = append(got[id], m)
		case <-deadline:
			w.mu.Lock()
			held, waiting, used := len(w.held), len(w.waiting), w.memUsed
			w.mu.Unlock()
			t.Fatalf("after 15 s the due tasks answered %v; %d deliveries held for their ETA, %d waiting for memory, "+
				"%d of %d bytes charged", got, held, waiting, used, cfg.MemoryBudget)
		}
	}
	if _, err := e.ch.QueuePurge(e.queue, false); err != nil {
		t.Fatal(err)
	}
}

// TestFullReplyQueueDoesNotRerunTask: a producer names as reply_to a
// queue that refuses every publish (x-max-length 0, overflow
// reject-publish: the broker nacks). As Celery's worker, the worker sends
// the result (lost) and acknowledges: the task runs once, not again and
// again.
func TestFullReplyQueueDoesNotRerunTask(t *testing.T) {
	e := newEnv(t)
	var runs atomic.Int32
	r := NewRegistry()
	if err := Register(r, Task[blockArgs]{Name: "t.count", Run: func(context.Context, *Call, blockArgs) (any, error) {
		runs.Add(1)
		return "ok", nil
	}}); err != nil {
		t.Fatal(err)
	}
	cfg := e.config()
	e.start(r, cfg)
	full := testenv.Name("full")
	if _, err := e.ch.QueueDeclare(full, false, true, false, false, amqp091.Table{
		"x-max-length": int32(0), "x-overflow": "reject-publish"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = e.ch.QueueDelete(full, false, false, false) })
	e.publish(&celeryproto.Message{Task: "t.count", ID: taskID(1), Kwargs: map[string]any{"pad": "x"}, ReplyTo: full})
	time.Sleep(25 * time.Second)
	if n := runs.Load(); n != 1 {
		t.Fatalf("task ran %d times in 25 s, want once (its reply queue refuses every publish)", n)
	}
	if _, err := e.ch.QueuePurge(e.queue, false); err != nil {
		t.Fatal(err)
	}
}

// TestQuorumWindowCapBoundsIntake: on a quorum queue the prefetch window
// is per consumer, and a change restarts the consumers with a full window
// of their own: the worker does not cap it there, and holds no more
// deliveries than its prefetch window while it is short of memory.
func TestQuorumWindowCapBoundsIntake(t *testing.T) {
	e := newEnv(t)
	q := e.queue + "_qq"
	if _, err := e.ch.QueueDeclare(q, true, false, false, false, amqp091.Table{"x-queue-type": "quorum"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = e.ch.QueueDelete(q, false, false, false)
		_, _ = e.ch.QueueDelete(quarantineName(q), false, false, false)
	})
	release := make(chan struct{})
	started := make(chan string, 200)
	cfg := e.config()
	cfg.Queues = []amqp.QueueSpec{{Name: q, Exchange: amqp.DefaultExchange, Durable: true, Quorum: true}}
	cfg.Concurrency, cfg.Prefetch = 1, 8
	cfg.MemoryBudget = 64 << 20 // bodies up to 8 MiB, decoded values up to 16 MiB
	r := e.start(blockRegistry(t, release, started), cfg)
	defer close(release)
	w := r.w
	// Bodies of 4 MiB: decoded on arrival, eight of them fill the budget.
	const n = 30
	for i := range n {
		p, err := celeryproto.EncodeTask(&celeryproto.Message{Task: "t.block", ID: taskID(i),
			Kwargs: map[string]any{"pad": strings.Repeat("p", 4<<20)}}, celeryproto.EncodeOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if err := e.ch.PublishWithContext(context.Background(), "", q, false, false, amqp091.Publishing{
			ContentType: p.ContentType, ContentEncoding: p.ContentEncoding, Headers: amqp091.Table(p.Headers),
			Body: p.Body, DeliveryMode: 2}); err != nil {
			t.Fatal(err)
		}
	}
	most, waited := 0, false
	deadline := time.Now().Add(8 * time.Second)
	for time.Now().Before(deadline) {
		w.mu.Lock()
		held := len(w.reserved) + len(w.active)
		waited = waited || len(w.waiting) > 0
		w.mu.Unlock()
		most = max(most, held)
		time.Sleep(5 * time.Millisecond)
	}
	if !waited {
		t.Fatal("no delivery waited for memory: the test did not reach the cap")
	}
	if most > cfg.Prefetch {
		t.Errorf("the worker held up to %d deliveries of about 4 MiB while short of memory, more than its prefetch window of %d",
			most, cfg.Prefetch)
	}
}
