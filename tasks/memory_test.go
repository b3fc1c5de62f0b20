package tasks

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/testkit"
)

// blockArgs are the arguments of t.block: Pad makes a message as large as
// a test needs.
type blockArgs struct {
	Pad string `json:"pad"`
}

// blockRegistry registers t.block, a pure task that waits until release
// is closed, and counts its runs in started.
func blockRegistry(t *testing.T, release <-chan struct{}, started chan<- string) *Registry {
	t.Helper()
	r := NewRegistry()
	if err := Register(r, Task[blockArgs]{Name: "t.block", Run: func(ctx context.Context, c *Call, _ blockArgs) (any, error) {
		started <- c.TaskID
		select {
		case <-release:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		return "ok", nil
	}}); err != nil {
		t.Fatal(err)
	}
	return r
}

func (e *env) publishBlock(id string, pad int, replyTo string, eta time.Time) {
	e.t.Helper()
	m := &celeryproto.Message{Task: "t.block", ID: id, Kwargs: map[string]any{"pad": strings.Repeat("p", pad)},
		ReplyTo: replyTo, ETA: eta}
	e.publish(m)
}

// TestMemoryBudgetHoldsDeliveriesBeforeDecoding: deliveries that do not fit
// the budget wait undecoded (and the prefetch window closes) until the
// ones running release their charge; then every one runs.
func TestMemoryBudgetHoldsDeliveriesBeforeDecoding(t *testing.T) {
	e := newEnv(t)
	release := make(chan struct{})
	started := make(chan string, 100)
	cfg := e.config()
	cfg.Concurrency, cfg.Prefetch = 8, 32
	cfg.MemoryBudget = 64 << 20 // bodies up to 8 MiB, decoded values up to 16 MiB
	r := e.start(blockRegistry(t, release, started), cfg)
	w := r.w
	replyTo, replies := e.replyQueue()
	const n = 8
	for i := range n {
		e.publishBlock(taskID(i), 5<<20, replyTo, time.Time{}) // about 21 MiB each before decoding, 10 MiB decoded
	}
	testkit.WaitFor(t, "deliveries waiting for memory", 10*time.Second, func() bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		return len(w.waiting) > 0
	})
	time.Sleep(500 * time.Millisecond)
	w.mu.Lock()
	used, waiting, running := w.memUsed, len(w.waiting), len(w.active)
	w.mu.Unlock()
	if used > cfg.MemoryBudget {
		t.Errorf("charged %d bytes, above the budget %d", used, cfg.MemoryBudget)
	}
	if running+waiting > n || running == n || running == 0 {
		t.Errorf("%d running, %d waiting for memory, of %d", running, waiting, n)
	}
	if p := consumerOf(w).Prefetch(); p > n {
		t.Errorf("prefetch in force %d while deliveries wait for memory", p)
	}
	close(release)
	res := results(t, replies, n, 30*time.Second)
	for i := range n {
		if r := res[taskID(i)]; len(r) != 1 || r[0]["status"] != "SUCCESS" {
			t.Errorf("task %d answered %v, want one SUCCESS", i, r)
		}
	}
	testkit.WaitFor(t, "charges released", 5*time.Second, func() bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		return w.memUsed == 0 && len(w.charged) == 0
	})
}

// TestMessageLargerThanBudgetRefused: a message whose decoding would need
// more than the whole budget is quarantined, undecoded, with the reason,
// and its caller answered once.
func TestMessageLargerThanBudgetRefused(t *testing.T) {
	e := newEnv(t)
	cfg := e.config()
	cfg.MemoryBudget = 64 << 20
	e.start(blockRegistry(t, make(chan struct{}), make(chan string, 10)), cfg)
	replyTo, replies := e.replyQueue()
	// 600 KiB of YAML: its parser takes about 160 times that, 96 MiB.
	body := "[[], {pad: " + strings.Repeat("a", 600<<10) + "}, {}]"
	id := taskID(1)
	e.publishRaw(&celeryproto.Publishing{ContentType: celeryproto.ContentTypeYAML, ContentEncoding: "utf-8", Body: []byte(body),
		Headers: map[string]any{"task": "t.block", "id": id, "lang": "py"}, ReplyTo: replyTo, CorrelationID: id})
	var got []amqp091.Delivery
	testkit.WaitFor(t, "quarantined", 10*time.Second, func() bool {
		got = append(got, e.quarantined()...)
		return len(got) > 0
	})
	reason := fmt.Sprint(got[0].Headers[HeaderDecodeReason])
	if got[0].Headers[HeaderReason] != ReasonUndecodable || !strings.Contains(reason, "memory budget") {
		t.Errorf("quarantined as %v (%s), want undecodable for the memory budget", got[0].Headers[HeaderReason], reason)
	}
	if r := results(t, replies, 1, 10*time.Second)[id]; len(r) != 1 || r[0]["status"] != "FAILURE" {
		t.Errorf("answered %v, want one FAILURE", r)
	}
}

// TestETAHeldBoundedByBytes: deliveries held for their ETA take at most
// half the budget; the others go back to the end of the queue, and a task
// due now still runs.
func TestETAHeldBoundedByBytes(t *testing.T) {
	e := newEnv(t)
	w := e.startETAWorker(64 << 20)
	replyTo, replies := e.replyQueue()
	later := time.Now().Add(time.Hour)
	for i := range 30 {
		e.publishBlock(taskID(i), 2<<20, "", later) // about 4 MiB each once decoded
	}
	e.publishBlock(taskID(100), 10, replyTo, time.Time{})
	if r := results(t, replies, 1, 20*time.Second)[taskID(100)]; len(r) != 1 || r[0]["status"] != "SUCCESS" {
		t.Errorf("task due now answered %v, want SUCCESS", r)
	}
	testkit.WaitFor(t, "deliveries sent back for the ETA share", 10*time.Second, func() bool {
		return counterValue(w.m.etaRequeued) > 0
	})
	w.mu.Lock()
	var held int64
	for j := range w.held {
		held += j.charge
	}
	nheld := len(w.held)
	w.mu.Unlock()
	if held > w.cfg.MemoryBudget/2+int64(w.cfg.Concurrency)*(5<<20) || nheld == 0 || nheld >= 30 {
		t.Errorf("%d deliveries held for their ETA, %d bytes charged; want some, within half the budget", nheld, held)
	}
	if _, err := e.ch.QueuePurge(e.queue, false); err != nil {
		t.Fatal(err)
	}
}

// TestStalledNotReady: with every slot held by tasks that do not finish,
// the worker reports not ready after StallAfter, and ready again once a
// delivery is settled.
func TestStalledNotReady(t *testing.T) {
	e := newEnv(t)
	release := make(chan struct{})
	started := make(chan string, 10)
	cfg := e.config()
	cfg.Concurrency, cfg.Prefetch = 2, 8
	cfg.StallAfter = 700 * time.Millisecond
	r := e.start(blockRegistry(t, release, started), cfg)
	replyTo, replies := e.replyQueue()
	e.publishBlock(taskID(1), 10, replyTo, time.Time{})
	<-started
	time.Sleep(1500 * time.Millisecond)
	if !r.w.Ready() {
		t.Fatal("not ready with one task of two running")
	}
	e.publishBlock(taskID(2), 10, replyTo, time.Time{})
	<-started
	if !r.w.Ready() {
		t.Error("not ready right after the slots filled")
	}
	testkit.WaitFor(t, "not ready", 5*time.Second, func() bool { return !r.w.Ready() })
	if gaugeValue(r.w.m.stalled) != 1 {
		t.Error("onceler_stalled is not 1")
	}
	close(release)
	testkit.WaitFor(t, "ready again", 5*time.Second, r.w.Ready)
	results(t, replies, 2, 10*time.Second)
}

// startETAWorker starts a worker of t.block (which returns at once) with
// 2 slots, a prefetch window of 40 and budget (the tests that use it run
// fewer than 200 tasks, the room of the channel that counts the runs).
func (e *env) startETAWorker(budget int64) *Worker {
	e.t.Helper()
	w, _ := e.startTwoSlots(budget, func(release <-chan struct{}, started chan<- string) *Registry {
		return blockRegistry(e.t, release, started)
	})
	return w
}

// startTwoSlots starts a worker of 2 slots, a prefetch window of 40 and
// budget, with the registry reg makes (its t.block released at once), and
// returns it with the channel that counts the runs (room for 200).
func (e *env) startTwoSlots(budget int64, reg func(release <-chan struct{}, started chan<- string) *Registry) (*Worker, chan string) {
	e.t.Helper()
	release := make(chan struct{})
	close(release)
	started := make(chan string, 200)
	cfg := e.config()
	cfg.Concurrency, cfg.Prefetch = 2, 40
	cfg.MemoryBudget = budget
	return e.start(reg(release, started), cfg).w, started
}

// gaugeValue reads a Prometheus gauge.
func gaugeValue(g prometheus.Gauge) float64 {
	var m dto.Metric
	if err := g.Write(&m); err != nil {
		return -1
	}
	return m.GetGauge().GetValue()
}

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
	w := e.startETAWorker(256 << 20)
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
				"%d of %d bytes charged", got, held, waiting, used, w.cfg.MemoryBudget)
		}
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
	q := e.quorumQueue()
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

// TestHeldETANotSentBackWhileTasksRun: deliveries held for their ETA go
// back to their queue only when they would keep a waiting delivery out once
// everything else is settled. Here two running tasks hold the room that
// arriving ETA deliveries need to be decoded (each charged about 66 MiB
// before, 4 MiB after): the arrivals wait their turn. Were held ones sent
// back for them, each copy would arrive short of room in its turn and send
// back others, for as long as the tasks run. Celery's protocol 2 carries
// the ETA in the headers, protocol 1 in the body: both alike.
func TestHeldETANotSentBackWhileTasksRun(t *testing.T) {
	for _, protocol := range []int{2, 1} {
		t.Run(fmt.Sprintf("protocol%d", protocol), func(t *testing.T) {
			e := newEnv(t)
			release := make(chan struct{})
			started := make(chan string, 100)
			cfg := e.config()
			cfg.Concurrency, cfg.Prefetch = 3, 40 // a slot free for held deliveries sent back
			cfg.MemoryBudget = 256 << 20
			w := e.start(blockRegistry(t, release, started), cfg).w
			replyTo, replies := e.replyQueue()
			// Two tasks of about 24 MiB each once decoded run until release.
			for i := range 2 {
				e.publishBlock(taskID(200+i), 12<<20, replyTo, time.Time{})
			}
			for range 2 {
				select {
				case <-started:
				case <-time.After(20 * time.Second):
					t.Fatal("the running tasks did not start")
				}
			}
			later := time.Now().Add(time.Hour)
			const n = 28
			for i := range n {
				p, err := celeryproto.EncodeTask(&celeryproto.Message{Task: "t.block", ID: taskID(i),
					Kwargs: map[string]any{"pad": strings.Repeat("p", 2<<20)}, ETA: later},
					celeryproto.EncodeOptions{Protocol: protocol})
				if err != nil {
					t.Fatal(err)
				}
				e.publishRaw(p)
			}
			testkit.WaitFor(t, "ETA deliveries held", 30*time.Second, func() bool {
				w.mu.Lock()
				defer w.mu.Unlock()
				return len(w.held) == n && len(w.waiting) == 0
			})
			if got := counterValue(w.m.etaRequeued); got != 0 {
				t.Errorf("%v deliveries held for their ETA were sent back to their queue, want none", got)
			}
			close(release)
			if r := results(t, replies, 2, 20*time.Second); len(r) != 2 {
				t.Errorf("running tasks answered %v, want both", r)
			}
			if _, err := e.ch.QueuePurge(e.queue, false); err != nil {
				t.Fatal(err)
			}
		})
	}
}
