package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testkit"
	"github.com/onceler/onceler/internal/workerhooks"
	"github.com/onceler/onceler/tasks"
)

// TestSQSCelery: Celery 5.2.6 with broker_url "sqs://" (kombu's SQS
// transport) and the Redis result backend calls demo tasks that an onceler
// worker (--sqs) runs: each get() has its answer, as from a Celery
// worker: plain calls, a chain (its next step sent to SQS by the worker), a
// countdown (an ETA), a task that retries (its next try sent to SQS with a
// delay), a failure (the caller gets the exception) and an expired call
// (REVOKED, never run). The queue is empty afterwards.
func TestSQSCelery(t *testing.T) {
	t.Parallel()
	e := newSQSEnv(t, sqsEnvOptions{})
	// Expired before any worker sees it.
	expired := e.celery([]sqsCall{{Task: demo.TaskAdd, Args: []any{1, 1}, Expires: 1}}, 0).IDs[0]
	time.Sleep(1500 * time.Millisecond)
	e.startWorker(sqsWorkerOptions{})
	flakyOp := testkit.Name("flaky")
	start := time.Now()
	out := e.celery([]sqsCall{
		{Task: demo.TaskAdd, Args: []any{2, 3}},
		{Task: demo.TaskAdd, Args: []any{40, 2}},
		{Chain: []sqsCall{{Task: demo.TaskAdd, Args: []any{1, 1}}, {Task: demo.TaskAdd, Args: []any{10}}}},
		{Task: demo.TaskAdd, Args: []any{5, 5}, Countdown: 3},
		{Task: demo.TaskFlaky, Args: []any{flakyOp, 2}},
		{Task: demo.TaskFail, Args: []any{"no such thing"}},
	}, time.Minute)
	took := time.Since(start)
	want := []struct{ status, value string }{
		{"SUCCESS", "5"}, {"SUCCESS", "42"}, {"SUCCESS", "12"}, {"SUCCESS", "10"}, {"SUCCESS", ""}, {"ValueError", `"no such thing"`},
	}
	if len(out.Results) != len(want) {
		t.Fatalf("results %+v, want %d", out.Results, len(want))
	}
	for i, w := range want {
		r := out.Results[i]
		if r.Status != w.status || (w.value != "" && string(r.Value) != w.value) {
			t.Errorf("call %d (%s): get() gave %s %s, want %s %s", i, out.IDs[i], r.Status, r.Value, w.status, w.value)
		}
	}
	var flaky map[string]any
	if err := json.Unmarshal(out.Results[4].Value, &flaky); err != nil || fmt.Sprint(flaky["attempts"]) != "3" {
		t.Errorf("flaky task: %s, want its third attempt to succeed", out.Results[4].Value)
	}
	if took < 3*time.Second {
		t.Errorf("all answered in %v: the countdown of 3 s was not kept", took)
	}
	meta, err := e.rdb.Get(context.Background(), "celery-task-meta-"+expired).Result()
	if err != nil || !strings.Contains(meta, `"REVOKED"`) {
		t.Errorf("expired call's result: %q (err %v), want REVOKED", meta, err)
	}
	testkit.WaitFor(t, "the queue empty", 30*time.Second, e.idle)
	if q := e.depth(sqsQuarantineOf(e.queue)); q != 0 {
		t.Errorf("quarantine queue holds %d, want 0", q)
	}
	t.Logf("6 calls answered through SQS in %v", took.Round(time.Millisecond))
}

// TestSQSPlain: plain messages from boto3 (the body the arguments as JSON,
// the task a "task" attribute, or the queue's from --queues name=task):
// each operation has its effect once, the same message sent three times
// included, and the record holds it under its key.
func TestSQSPlain(t *testing.T) {
	t.Parallel()
	e := newSQSEnv(t, sqsEnvOptions{NoRedis: true})
	e.startWorker(sqsWorkerOptions{Queues: e.queue + "=" + demo.TaskCredit})
	prefix := testkit.Name("plain")
	var msgs []sqsMessage
	var ops []string
	for i := range 6 {
		op := fmt.Sprintf("%s-%d", prefix, i)
		ops = append(ops, op)
		body := fmt.Sprintf(`["acct-%s", %q, 125]`, op, op)
		m := sqsMessage{Body: body}
		if i%2 == 0 {
			m.Attributes = map[string]string{"task": demo.TaskCredit}
		}
		msgs = append(msgs, m)
		if i == 0 {
			msgs = append(msgs, m, m) // the same message three times
		}
	}
	// Keyword arguments: a JSON object.
	kwOp := prefix + "-kw"
	ops = append(ops, kwOp)
	msgs = append(msgs, sqsMessage{Body: fmt.Sprintf(`{"account": "acct-kw", "entry_id": %q, "cents": 7}`, kwOp)})
	e.plain(msgs...)
	ctx := context.Background()
	testkit.WaitFor(t, "every operation completed", 60*time.Second, func() bool {
		for _, op := range ops {
			if rec, err := e.store.Get(ctx, demo.TaskCredit, op); err != nil || rec.Status != idempotency.StatusCompleted {
				return false
			}
		}
		return e.idle()
	})
	for _, op := range ops {
		if n, err := demo.CountLedger(ctx, e.pool, op); err != nil || n != 1 {
			t.Errorf("operation %s: %d ledger entries (err %v), want 1", op, n, err)
		}
	}
	rec, err := e.store.Get(ctx, demo.TaskCredit, ops[0])
	if err != nil || rec.Duplicates < 2 {
		t.Errorf("record of the message sent three times: %+v (err %v), want 2 duplicates counted", rec, err)
	}
}

// TestSQSQuarantine: a body that is no JSON, a message naming no task, an
// unknown task and arguments that do not bind each go to the quarantine
// queue ("<queue>-quarantine"), the body as sent and the reason as message
// attributes, never run and never retried; a queue whose redrive policy
// names a dead-letter queue quarantines there instead.
func TestSQSQuarantine(t *testing.T) {
	t.Parallel()
	t.Run("own", func(t *testing.T) {
		t.Parallel()
		e := newSQSEnv(t, sqsEnvOptions{NoRedis: true})
		e.startWorker(sqsWorkerOptions{})
		sqsQuarantineCheck(t, e, sqsQuarantineOf(e.queue))
	})
	t.Run("dead_letter", func(t *testing.T) {
		t.Parallel()
		dlq := strings.ReplaceAll(testkit.Name("sqsdlq"), "_", "-")
		ctx := context.Background()
		e0 := newSQSEnv(t, sqsEnvOptions{NoRedis: true})
		if _, err := e0.client.CreateQueue(ctx, dlq, nil); err != nil {
			t.Fatal(err)
		}
		e := newSQSEnv(t, sqsEnvOptions{NoRedis: true, Attributes: map[string]string{
			"RedrivePolicy": fmt.Sprintf(`{"maxReceiveCount":"10","deadLetterTargetArn":"arn:aws:sqs:us-east-1:000000000000:%s"}`, dlq)}})
		e.startWorker(sqsWorkerOptions{})
		sqsQuarantineCheck(t, e, dlq)
		if n := e.depth(sqsQuarantineOf(e.queue)); n > 0 {
			t.Errorf("%s holds %d, want nothing there", sqsQuarantineOf(e.queue), n)
		}
	})
}

// TestSQSQuarantineCommand: onceler quarantine --sqs lists the quarantined
// messages of an SQS queue with their reasons (they stay), drops one by its
// task id and requeues the rest to the queue they came from (a worker
// quarantines it again: its task is still unknown).
func TestSQSQuarantineCommand(t *testing.T) {
	t.Parallel()
	e := newSQSEnv(t, sqsEnvOptions{NoRedis: true})
	e.startWorker(sqsWorkerOptions{})
	e.plain(sqsMessage{Body: "[1]", Attributes: map[string]string{"task": "no.such.task"}},
		sqsMessage{Body: "{{", Attributes: map[string]string{"task": demo.TaskAdd}})
	quarantine := sqsQuarantineOf(e.queue)
	testkit.WaitFor(t, "both quarantined", 60*time.Second, func() bool { return e.depth(quarantine) == 2 && e.idle() })
	run := func(args ...string) string {
		t.Helper()
		cmd := exec.Command(oncelerBin, append([]string{"quarantine", "--sqs", "--sqs-endpoint", e.endpoint, "--queues", e.queue}, args...)...)
		cmd.Env = append(os.Environ(), testkit.SQSEnv()...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("onceler quarantine %v: %v\n%s", args, err, out)
		}
		return string(out)
	}
	var listed []struct {
		TaskID string `json:"task_id"`
		Task   string `json:"task"`
		Reason string `json:"reason"`
		Queue  string `json:"queue"`
	}
	if err := json.Unmarshal([]byte(run("list", "--json")), &listed); err != nil || len(listed) != 2 {
		t.Fatalf("list: %+v (err %v), want 2", listed, err)
	}
	reasons := map[string]string{}
	for _, m := range listed {
		reasons[m.Task] = m.Reason
		if m.Queue != e.queue || m.TaskID == "" {
			t.Errorf("listed %+v: want queue %s and a task id", m, e.queue)
		}
	}
	if reasons["no.such.task"] != tasks.ReasonUnknownTask || reasons[demo.TaskAdd] != tasks.ReasonUndecodable {
		t.Errorf("reasons %v", reasons)
	}
	testkit.WaitFor(t, "the listed messages visible again", 10*time.Second, func() bool {
		_, inFlight := e.countsOf(quarantine)
		return inFlight == 0
	})
	var undecodable string
	for _, m := range listed {
		if m.Reason == tasks.ReasonUndecodable {
			undecodable = m.TaskID
		}
	}
	if out := run("drop", undecodable); !strings.Contains(out, "dropped 1 of 2") {
		t.Errorf("drop: %s", out)
	}
	if out := run("requeue", "--all"); !strings.Contains(out, "requeued 1 of 1") {
		t.Errorf("requeue: %s", out)
	}
	testkit.WaitFor(t, "the requeued message quarantined again", 30*time.Second, func() bool { return e.depth(quarantine) == 1 && e.idle() })
	if ms := e.drain(quarantine, 1); len(ms) != 1 || ms[0].Attributes["task"] != "no.such.task" {
		t.Errorf("quarantine holds %+v, want the unknown task's message", ms)
	}
}

func sqsQuarantineCheck(t *testing.T, e *sqsEnv, quarantine string) {
	bad := []struct {
		m      sqsMessage
		reason string
	}{
		{sqsMessage{Body: "not json at all", Attributes: map[string]string{"task": demo.TaskAdd}}, tasks.ReasonUndecodable},
		{sqsMessage{Body: "[1, 2]"}, tasks.ReasonUndecodable},
		{sqsMessage{Body: "[1, 2]", Attributes: map[string]string{"task": "no.such.task"}}, tasks.ReasonUnknownTask},
		{sqsMessage{Body: `["a", "b", "c", "d"]`, Attributes: map[string]string{"task": demo.TaskCredit}}, tasks.ReasonBadArguments},
	}
	var msgs []sqsMessage
	for _, b := range bad {
		msgs = append(msgs, b.m)
	}
	e.plain(msgs...)
	testkit.WaitFor(t, "all four quarantined", 60*time.Second, func() bool { return e.depth(quarantine) == len(bad) && e.idle() })
	got := map[string]string{}
	for _, m := range e.drain(quarantine, len(bad)) {
		got[m.Body+"|"+m.Attributes["task"]] = m.Attributes[tasks.HeaderReason]
		if m.Attributes[tasks.HeaderDetail] == "" {
			t.Errorf("quarantined %q: no %s attribute (%v)", m.Body, tasks.HeaderDetail, m.Attributes)
		}
	}
	for _, b := range bad {
		if r := got[b.m.Body+"|"+b.m.Attributes["task"]]; r != b.reason {
			t.Errorf("%q (task %q): quarantined with reason %q, want %q (all: %v)", b.m.Body, b.m.Attributes["task"], r, b.reason, got)
		}
	}
}

// TestSQSVisibilityExtended: a task that runs three times as long as the
// queue's visibility timeout keeps its message invisible (the worker
// extends it): it runs once, on one worker of two, and is deleted after
// its completion.
func TestSQSVisibilityExtended(t *testing.T) {
	t.Parallel()
	e := newSQSEnv(t, sqsEnvOptions{NoRedis: true, Visibility: 2 * time.Second})
	w1 := e.startWorker(sqsWorkerOptions{})
	w2 := e.startWorker(sqsWorkerOptions{})
	op := testkit.Name("slow")
	e.plain(sqsMessage{Body: fmt.Sprintf(`[%q, 6]`, op), Attributes: map[string]string{"task": demo.TaskSleep}})
	ctx := context.Background()
	testkit.WaitFor(t, "the slow task completed", 60*time.Second, func() bool {
		rec, err := e.store.Get(ctx, demo.TaskSleep, op)
		return err == nil && rec.Status == idempotency.StatusCompleted
	})
	testkit.WaitFor(t, "the queue empty", 30*time.Second, e.idle)
	rec, _ := e.store.Get(ctx, demo.TaskSleep, op)
	if rec.Attempt != 1 || rec.Duplicates != 0 {
		t.Errorf("record: attempt %d, %d duplicates; want one attempt, no duplicate", rec.Attempt, rec.Duplicates)
	}
	for _, w := range []*skWorker{w1, w2} {
		if strings.Contains(w.Log(), "no longer in flight") {
			t.Errorf("worker %s lost the message's visibility:\n%s", w.Name, w.LogTail(3000))
		}
	}
}

// TestSQSHeldResolve: a worker killed after claiming an email (policy
// hold) leaves the operation held when its message comes back; onceler
// resolve --retry releases the record and sends the kept SQS message
// again, and a worker sends the email once.
func TestSQSHeldResolve(t *testing.T) {
	t.Parallel()
	e := newSQSEnv(t, sqsEnvOptions{NoRedis: true})
	email := skTargets()[2]
	op := testkit.Name("held")
	run := &sqsRun{}
	w1 := e.startWorker(sqsWorkerOptions{CrashAt: workerhooks.AfterClaim, CrashTask: email.task, Concurrency: 1, Prefetch: 1})
	e.plain(run.plainMessage(email.task, email.args(op)))
	if !testkit.Eventually(60*time.Second, w1.Exited) || !w1.Crashed() {
		t.Fatalf("armed worker did not crash: %s", w1.LogTail(3000))
	}
	e.startWorker(sqsWorkerOptions{})
	ctx := context.Background()
	testkit.WaitFor(t, "the operation held", 60*time.Second, func() bool {
		rec, err := e.store.Get(ctx, email.task, op)
		return err == nil && rec.Status == idempotency.StatusHeld && e.idle()
	})
	cmd := exec.Command(oncelerBin, "resolve", "--retry", "--sqs-endpoint", e.endpoint, email.task, op)
	cmd.Env = append(os.Environ(), append(testkit.SQSEnv(), "ONCELER_DATABASE_URL="+e.dbURL, "ONCELER_SCHEMA="+e.schema)...)
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "sent again to SQS queue "+e.queue) {
		t.Fatalf("onceler resolve --retry: %v: %s", err, out)
	}
	testkit.WaitFor(t, "the operation completed", 60*time.Second, func() bool {
		rec, err := e.store.Get(ctx, email.task, op)
		return err == nil && rec.Status == idempotency.StatusCompleted && e.idle()
	})
	if n, err := email.effects(ctx, e.pool, op); err != nil || n != 1 {
		t.Errorf("emails sent: %d (err %v), want 1", n, err)
	}
}
