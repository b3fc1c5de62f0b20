package integration

import (
	"context"
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/internal/testkit"
)

// The broker's limits: RabbitMQ's consumer_timeout and its resource
// alarms, each on a private node (the settings are node-wide).

// consumerTimeoutWarning is the start of the warning the worker logs when
// the broker closes its channel at consumer_timeout (amqp.Consumer).
const consumerTimeoutWarning = "consumer_timeout: the broker closed the channel"

// track adds to the workload an operation of task whose call the worker
// publishes itself (a chain's next step, task id id), so that check
// asserts its effect and its caller's answer too.
func (w *workload) track(task, op, id string) {
	o := &operation{task: task, op: op, msgs: []*celeryproto.Message{{Task: task, ID: id}}}
	w.by[op] = o
	w.ops = append(w.ops, o)
}

// answeredOnce asserts that every task id got exactly one reply that ends
// its call (RETRY replies are not counted), none other, after waiting a
// while for late ones (a result sent twice arrives after the first).
func answeredOnce(t *testing.T, e *replay.Env, ids []string) {
	t.Helper()
	time.Sleep(3 * time.Second)
	for _, id := range ids {
		if reps := final(e.Replies(id)); len(reps) != 1 {
			t.Errorf("caller %s got %d results, want 1: %v", id, len(reps), reps)
		}
	}
}

// logLine returns the first line of log that holds msg, "" if none.
func logLine(log, msg string) string {
	for _, line := range strings.Split(log, "\n") {
		if strings.Contains(line, msg) {
			return line
		}
	}
	return ""
}

// queueCount returns the messages of queue on the private node, ready and
// unacknowledged (delivered to a consumer, not yet acknowledged).
func (r *privateRabbit) queueCount(t *testing.T, queue string) (ready, unacked int) {
	t.Helper()
	out, err := r.ctl("-q", "list_queues", "name", "messages_ready", "messages_unacknowledged")
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[0] == queue {
			ready, _ = strconv.Atoi(f[1])
			unacked, _ = strconv.Atoi(f[2])
			return ready, unacked
		}
	}
	t.Fatalf("queue %s not listed:\n%s", queue, out)
	return 0, 0
}

// TestFaultConsumerTimeout runs tasks longer than RabbitMQ's
// consumer_timeout (5 s on a private node, checked every second): the
// broker closes the worker's channel while they run and puts their
// messages back in the queue; the worker reconnects and gets them again.
// Each run commits its effect and its record; the redelivery is answered
// from the record (the same-database one waits for the run's transaction,
// the outside one for its claim), and the run that lost its delivery sends
// nothing: every caller gets one result, every effect happens once, the
// queue ends empty, and the worker says once what happened and which
// setting to raise.
//
// The tasks take 8 s: past the timeout plus one check, and short enough
// that the redeliveries, which wait for the runs in progress, are not
// timed out in their turn.
func TestFaultConsumerTimeout(t *testing.T) {
	faultTests(t)
	start := time.Now()
	// channel_tick_interval: how often a channel checks its oldest
	// unacknowledged delivery against consumer_timeout (a minute by
	// default in RabbitMQ 3.10).
	rb := newRabbit(t, rabbitOptions{conf: "consumer_timeout = 5000\n",
		advanced: "[{rabbit, [{channel_tick_interval, 1000}]}]."})
	rb.await(t)
	e := replay.NewEnv(t, replay.Config{Binary: ownBin, AMQPURL: rb.url})
	migrate(t, e)
	w := e.StartWorker(replay.WorkerOptions{})
	wl := newWorkload(e)
	wl.ctl = rb.ctl
	const long = 8.0
	wl.sendArgs(demo.TaskSleep, wl.op("ct-sleep", 0), []any{wl.op("ct-sleep", 0), long})
	wl.sendArgs("replay.slow", wl.op("ct-slow", 0), []any{wl.op("ct-slow", 0), long})
	for i := range 6 {
		wl.send(demo.TaskCredit, wl.op("ct-credit", i))
	}
	if !wl.wait(2 * time.Minute) {
		t.Errorf("%d of %d calls answered", wl.answered(), len(wl.ids()))
	}
	answeredOnce(t, e, wl.ids())
	wl.stopWorkers()
	tl := wl.check(t)
	log := w.Log()
	if n := strings.Count(log, consumerTimeoutWarning); n != 1 {
		t.Errorf("consumer_timeout warning logged %d times, want once (one channel closed)", n)
	}
	if n := strings.Count(log, "delivery lost while the task ran"); n != 2 {
		t.Errorf("%d runs reported their delivery lost, want 2 (the two long tasks)", n)
	}
	t.Logf("operations %d, effects once %d, duplicates %d, lost %d, calls %d answered once %d; took %s",
		tl.ops, tl.ops-tl.duplicates-tl.lost, tl.duplicates, tl.lost, tl.calls, tl.answered, time.Since(start).Round(time.Second))
}

// alarmFor is how long TestFaultMemoryAlarm holds the alarm: longer than
// the worker's bound on one publish (30 s), which a blocked publish must
// wait out rather than give up and send again.
const alarmFor = 40 * time.Second

// TestFaultMemoryAlarm sets a memory alarm on a private node
// (set_vm_memory_high_watermark 0.0000001) before the worker starts
// consuming a batch of plain tasks (same-database and lookup), a task that
// asks for one retry and a two-step chain. The alarm blocks every
// connection that publishes: the worker runs tasks, but their results, the
// retry and the chain's next step wait for their confirms, and no delivery
// is acknowledged meanwhile. 40 s later (alarmFor) the alarm clears: every caller is
// answered once, every effect happened once, the retry ran to its end and
// the chain's step ran once.
func TestFaultMemoryAlarm(t *testing.T) {
	faultTests(t)
	start := time.Now()
	rb := startRabbit(t)
	e := replay.NewEnv(t, replay.Config{Binary: ownBin, AMQPURL: rb.url})
	migrate(t, e)
	wl := newWorkload(e)
	wl.ctl = rb.ctl
	// The harness publishes everything before the alarm: its connection
	// (which also consumes the replies) publishes nothing while it holds,
	// so the broker never blocks it.
	for i := range 12 {
		wl.send(demo.TaskCredit, wl.op("alarm-credit", i))
	}
	for i := range 4 {
		wl.send(demo.TaskCharge, wl.op("alarm-charge", i))
	}
	flakyOp := wl.op("alarm-flaky", 0)
	flaky := e.Send(demo.TaskFlaky, []any{flakyOp, 1}, nil)
	stepOp, stepID := wl.op("alarm-chain", 1), testkit.NewID()
	first := wl.op("alarm-chain", 0)
	m := e.Message(demo.TaskCredit, testkit.NewID(), args(demo.TaskCredit, first), nil)
	m.Chain = []celeryproto.Signature{{Task: demo.TaskCredit, Args: args(demo.TaskCredit, stepOp), Kwargs: map[string]any{},
		Options: map[string]any{"task_id": stepID, "reply_to": e.ReplyTo}, Immutable: true}}
	wl.ops = append(wl.ops, &operation{task: demo.TaskCredit, op: first, msgs: []*celeryproto.Message{m}})
	wl.by[first] = wl.ops[len(wl.ops)-1]
	e.Publish(m)
	wl.track(demo.TaskCredit, stepOp, stepID)
	// Published: the workload's calls but the chain's step (the worker
	// sends it), and demo.flaky: as many.
	sent := len(wl.ids())
	rb.mustCtl(t, "set_vm_memory_high_watermark", "0.0000001")
	alarmed := time.Now()
	w := e.StartWorker(replay.WorkerOptions{})
	// While the alarm holds: tasks run (their records complete), nothing
	// is answered, nothing acknowledged.
	time.Sleep(time.Until(alarmed.Add(alarmFor)))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	completed := 0
	for _, o := range wl.ops {
		if rec, err := e.Store.Get(ctx, o.task, o.op); err == nil && rec.Status == idempotency.StatusCompleted {
			completed++
		}
	}
	ready, unacked := rb.queueCount(t, e.Queue)
	replies := e.ReplyCount()
	if replies != 0 {
		t.Errorf("%d callers answered while the alarm held, want none", replies)
	}
	if ready+unacked != sent {
		t.Errorf("queue holds %d ready + %d unacknowledged while the alarm held, want the %d sent (none acknowledged)", ready, unacked, sent)
	}
	if completed == 0 || unacked == 0 {
		t.Errorf("%d operations completed, %d deliveries held, while the alarm held: want the worker to have run tasks", completed, unacked)
	}
	blocked := logLine(w.Log(), "broker blocks publishing")
	if !strings.Contains(blocked, "low on memory") {
		t.Errorf("the worker did not log that the broker blocks publishing, and why: %q", blocked)
	}
	t.Logf("alarm held %s: %d operations completed, %d ready + %d unacknowledged of %d sent, %d answered",
		time.Since(alarmed).Round(time.Second), completed, ready, unacked, sent, replies)
	rb.mustCtl(t, "set_vm_memory_high_watermark", "0.4")
	cleared := time.Now()
	if !wl.wait(2 * time.Minute) {
		t.Errorf("%d of %d calls answered after the alarm cleared", wl.answered(), len(wl.ids()))
	}
	if !e.WaitReplies([]string{flaky}, 2, time.Minute) {
		t.Errorf("retried task: replies %v, want RETRY then SUCCESS", e.Replies(flaky))
	}
	drained := time.Since(cleared)
	answeredOnce(t, e, append(wl.ids(), flaky))
	wl.stopWorkers()
	tl := wl.check(t)
	// The retried task: one RETRY, one SUCCESS after its second run.
	var retries int
	for _, r := range e.Replies(flaky) {
		if r.Status == "RETRY" {
			retries++
		}
	}
	rec, err := e.Store.Get(ctx, demo.TaskFlaky, flakyOp)
	var res demo.FlakyResult
	if err != nil || rec.Status != idempotency.StatusCompleted || json.Unmarshal(rec.Result, &res) != nil || res.Attempts != 2 || retries != 1 {
		t.Errorf("retried task: record %v %s (err %v), %d RETRY replies; want completed after 2 attempts, one RETRY", rec.Status, rec.Result, err, retries)
	}
	if logLine(w.Log(), "broker unblocked publishing") == "" {
		t.Errorf("the worker did not log that the broker unblocked publishing")
	}
	t.Logf("operations %d (and a retried task), effects once %d, duplicates %d, lost %d, calls %d answered %d; drained in %s after the alarm; took %s",
		tl.ops, tl.ops-tl.duplicates-tl.lost, tl.duplicates, tl.lost, tl.calls, tl.answered, drained.Round(time.Millisecond),
		time.Since(start).Round(time.Second))
}
