package integration

import (
	"context"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/internal/testkit"
)

// Edges of "a run whose delivery was lost leaves its answer to the
// redelivery only when that redelivery is sure to come and be answered
// from the record" (tasks.Worker.lostWhileRunning), on a private node with
// consumer_timeout = 5000 (checked every second): in each case here the
// redelivery may not come or not answer as the run would, so the run
// answers.

// consumerTimeoutNode starts the private node TestFaultConsumerTimeout uses.
func consumerTimeoutNode(t *testing.T) *privateRabbit {
	t.Helper()
	rb := newRabbit(t, rabbitOptions{conf: "consumer_timeout = 5000\n",
		advanced: "[{rabbit, [{channel_tick_interval, 1000}]}]."})
	rb.await(t)
	return rb
}

// TestFaultConsumerTimeoutExpiresBeforeRedelivery: a same-database task
// (demo.sleep, 8 s) with an expires 4 s after it is sent, and a chain's next
// step. It starts in time; the broker takes its delivery back at
// consumer_timeout (5-6 s), after the expiry. The run commits its effect and
// its record (SUCCESS); its message has an expiry, so it answers (result
// and chain step) itself:
//   - "ttl": the message carries the AMQP expiration Celery's apply_async
//     sets from expires (celery/app/base.py: options["expiration"]): the
//     broker drops it when it goes back to the queue past its TTL; there is
//     no redelivery;
//   - "header": expires in the header alone: the redelivery, expired, finds
//     the run in progress in the record, waits for it and answers SUCCESS
//     from the record (not REVOKED): the caller may get SUCCESS twice.
func TestFaultConsumerTimeoutExpiresBeforeRedelivery(t *testing.T) {
	faultTests(t)
	rb := consumerTimeoutNode(t)
	for _, ttl := range []bool{true, false} {
		name := "header"
		if ttl {
			name = "ttl"
		}
		t.Run(name, func(t *testing.T) {
			e := replay.NewEnv(t, replay.Config{Binary: ownBin, AMQPURL: rb.url})
			migrate(t, e)
			w := e.StartWorker(replay.WorkerOptions{})

			op, stepOp, stepID := "exp-"+testkit.NewID(), "exp-step-"+testkit.NewID(), testkit.NewID()
			m := e.Message(demo.TaskSleep, testkit.NewID(), []any{op, 8.0}, nil)
			m.Expires = time.Now().Add(4 * time.Second)
			m.Chain = []celeryproto.Signature{{Task: demo.TaskCredit, Args: args(demo.TaskCredit, stepOp), Kwargs: map[string]any{},
				Options: map[string]any{"task_id": stepID, "reply_to": e.ReplyTo}, Immutable: true}}
			p, err := celeryproto.EncodeTask(m, celeryproto.EncodeOptions{Protocol: 2})
			if err != nil {
				t.Fatal(err)
			}
			if !ttl {
				p.Expiration = ""
			}
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			if err := e.PublishRaw(ctx, "", e.Queue, p); err != nil {
				t.Fatal(err)
			}

			// The run ends 8 s after it started; the redelivery comes at 6-7 s.
			var rec idempotency.Record
			testkit.Eventually(40*time.Second, func() bool {
				r, err := e.Store.Get(ctx, demo.TaskSleep, op)
				rec = r
				return err == nil && r.Status == idempotency.StatusCompleted
			})
			answered := e.WaitReplies([]string{m.ID}, 1, 20*time.Second)
			stepAnswered := e.WaitReplies([]string{stepID}, 1, 10*time.Second)
			ready, unacked := rb.queueCount(t, e.Queue)
			reps := e.Replies(m.ID)
			log := w.Log()
			t.Logf("record %s; caller answered %v: %v; chain step answered %v; queue %d ready %d unacknowledged; "+
				"lost-delivery log lines %d, expired log lines %d",
				rec.Status, answered, reps, stepAnswered, ready, unacked,
				strings.Count(log, "delivery lost while the task ran"), strings.Count(log, "task expired"))
			if rec.Status != idempotency.StatusCompleted {
				t.Fatalf("the task's record is %q, want completed (the run committed)", rec.Status)
			}
			// The run answers (its message has an expiry, so its redelivery
			// may never come); a redelivery, which waits for the run and is
			// answered from the record, answers SUCCESS again.
			if !allSuccess(reps) {
				t.Errorf("the task's effect and SUCCESS are recorded, but its caller got %v, want SUCCESS (once or more, nothing else)", reps)
			}
			if !stepAnswered {
				t.Errorf("the task completed, but the chain's next step %s was never sent", stepID)
			}
		})
	}
}

// TestFaultConsumerTimeoutSlowFailure: a task that fails after running
// longer than consumer_timeout (demo.sleep, 30 s, with a 7 s hard time
// limit: TimeLimitExceeded at 7 s). A same-database failure is rolled back,
// nothing recorded, so no redelivery answers it from the record: the run
// answers TimeLimitExceeded itself, as Celery's worker does, at 7 s (the
// redelivery runs the task again, as any redelivery of a failure).
func TestFaultConsumerTimeoutSlowFailure(t *testing.T) {
	faultTests(t)
	rb := consumerTimeoutNode(t)
	e := replay.NewEnv(t, replay.Config{Binary: ownBin, AMQPURL: rb.url})
	migrate(t, e)
	w := e.StartWorker(replay.WorkerOptions{})

	m := e.Message(demo.TaskSleep, testkit.NewID(), []any{"slowfail-" + testkit.NewID(), 30.0}, nil)
	m.TimeLimit = celeryproto.TimeLimit{Hard: 7 * time.Second}
	sent := time.Now()
	e.Publish(m)

	answered := e.WaitReplies([]string{m.ID}, 1, 60*time.Second)
	took := time.Since(sent)
	reps := e.Replies(m.ID)
	log := w.Log()
	lost := strings.Count(log, "delivery lost while the task ran")
	t.Logf("answered %v after %s: %v; runs that reported their delivery lost: %d; consumer_timeout warnings: %d",
		answered, took.Round(time.Second), reps, lost, strings.Count(log, consumerTimeoutWarning))
	if !answered {
		t.Fatalf("caller of a task failing after 7 s not answered in 60 s; %d runs lost their delivery", lost)
	}
	if reps[0].ExcType != "TimeLimitExceeded" || took > 25*time.Second {
		t.Errorf("caller told %s after %s and %d runs that lost their delivery; want TimeLimitExceeded after the first run (7 s)",
			reps[0].ExcType, took.Round(time.Second), lost)
	}
}

// TestFaultConsumerTimeoutDeliveryLimit: a quorum queue with
// x-delivery-limit 1 and a same-database task (demo.sleep, 8 s) with a
// chain's next step. The broker takes the delivery back at consumer_timeout
// (a return the quorum queue counts); the run commits its effect and its
// record (SUCCESS). Its redelivery is the broker's last (x-delivery-count 1
// = the limit), which the decode stage does not answer from the record, so
// the run answers (result and chain step) itself.
func TestFaultConsumerTimeoutDeliveryLimit(t *testing.T) {
	faultTests(t)
	rb := consumerTimeoutNode(t)
	e := replay.NewEnv(t, replay.Config{Binary: ownBin, AMQPURL: rb.url, Quorum: true,
		QueueArgs: map[string]any{"x-delivery-limit": int32(1)}})
	migrate(t, e)
	w := e.StartWorker(replay.WorkerOptions{})

	op, stepOp, stepID := "dl-"+testkit.NewID(), "dl-step-"+testkit.NewID(), testkit.NewID()
	m := e.Message(demo.TaskSleep, testkit.NewID(), []any{op, 8.0}, nil)
	m.Chain = []celeryproto.Signature{{Task: demo.TaskCredit, Args: args(demo.TaskCredit, stepOp), Kwargs: map[string]any{},
		Options: map[string]any{"task_id": stepID, "reply_to": e.ReplyTo}, Immutable: true}}
	e.Publish(m)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var rec idempotency.Record
	testkit.Eventually(40*time.Second, func() bool {
		r, err := e.Store.Get(ctx, demo.TaskSleep, op)
		rec = r
		return err == nil && r.Status == idempotency.StatusCompleted
	})
	e.WaitReplies([]string{m.ID}, 1, 20*time.Second)
	stepAnswered := e.WaitReplies([]string{stepID}, 1, 10*time.Second)
	reps := e.Replies(m.ID)
	log := w.Log()
	t.Logf("record %s; caller's replies %v; chain step answered %v; lost-delivery log lines %d; quarantine line: %s",
		rec.Status, reps, stepAnswered, strings.Count(log, "delivery lost while the task ran"),
		clipLine(logLine(log, "quarantine")))
	if rec.Status != idempotency.StatusCompleted {
		t.Fatalf("the task's record is %q, want completed (the run committed)", rec.Status)
	}
	// The run answers; the last delivery, if the worker hands it on to be
	// answered from the record, answers SUCCESS again.
	if !allSuccess(reps) {
		t.Errorf("the task's effect and SUCCESS are recorded, but its caller got %v, want SUCCESS (once or more, nothing else)", reps)
	}
	if !stepAnswered {
		t.Errorf("the task completed, but the chain's next step %s was never sent", stepID)
	}
}

// TestFaultBrokerRestartTransientMessage: a same-database task (demo.sleep,
// 6 s) sent transient (delivery_mode 1, as with Celery's
// task_default_delivery_mode = "transient") with a chain's next step; the
// broker restarts (stop_app, start_app) while it runs. The worker's channel
// closes with its connection; the run commits its effect and its record. A
// transient message does not survive the restart, so there is no
// redelivery: the run answers (result and chain step) itself, through its
// publisher's new connection.
func TestFaultBrokerRestartTransientMessage(t *testing.T) {
	faultTests(t)
	rb := startRabbit(t)
	e := replay.NewEnv(t, replay.Config{Binary: ownBin, AMQPURL: rb.url, DurableReplies: true})
	migrate(t, e)
	w := e.StartWorker(replay.WorkerOptions{})

	op, stepOp, stepID := "tr-"+testkit.NewID(), "tr-step-"+testkit.NewID(), testkit.NewID()
	m := e.Message(demo.TaskSleep, testkit.NewID(), []any{op, 6.0}, nil)
	m.Chain = []celeryproto.Signature{{Task: demo.TaskCredit, Args: args(demo.TaskCredit, stepOp), Kwargs: map[string]any{},
		Options: map[string]any{"task_id": stepID, "reply_to": e.ReplyTo}, Immutable: true}}
	p, err := celeryproto.EncodeTask(m, celeryproto.EncodeOptions{Protocol: 2})
	if err != nil {
		t.Fatal(err)
	}
	conn, err := amqp091.Dial(rb.url)
	if err != nil {
		t.Fatal(err)
	}
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	conf, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", e.Queue, false, false, amqp091.Publishing{
		ContentType: p.ContentType, ContentEncoding: p.ContentEncoding, Headers: amqp091.Table(p.Headers),
		Body: p.Body, CorrelationId: p.CorrelationID, ReplyTo: p.ReplyTo, DeliveryMode: amqp091.Transient})
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := conf.WaitContext(ctx); !ok || err != nil {
		t.Fatalf("confirm: %v %v", ok, err)
	}
	_ = conn.Close()

	if !testkit.Eventually(20*time.Second, func() bool { return strings.Contains(w.Log(), "sleep started") }) {
		t.Fatal("the task did not start")
	}
	rb.mustCtl(t, "stop_app")
	time.Sleep(2 * time.Second)
	rb.mustCtl(t, "start_app")
	rb.mustCtl(t, "await_startup")
	if err := e.Reconnect(); err != nil {
		t.Fatal(err)
	}
	var rec idempotency.Record
	testkit.Eventually(40*time.Second, func() bool {
		r, err := e.Store.Get(ctx, demo.TaskSleep, op)
		rec = r
		return err == nil && r.Status == idempotency.StatusCompleted
	})
	answered := e.WaitReplies([]string{m.ID}, 1, 30*time.Second)
	stepAnswered := e.WaitReplies([]string{stepID}, 1, 10*time.Second)
	log := w.Log()
	t.Logf("record %s; caller answered %v: %v; chain step answered %v; lost-delivery log lines %d",
		rec.Status, answered, e.Replies(m.ID), stepAnswered, strings.Count(log, "delivery lost while the task ran"))
	if rec.Status != idempotency.StatusCompleted {
		t.Fatalf("the task's record is %q, want completed (the run committed)", rec.Status)
	}
	if !answered {
		t.Errorf("the task's effect and SUCCESS are recorded, but its caller was never answered (its transient message did not survive the restart)")
	}
	if !stepAnswered {
		t.Errorf("the task completed, but the chain's next step %s was never sent", stepID)
	}
}

// allSuccess reports whether reps holds at least one reply and every one
// is SUCCESS.
func allSuccess(reps []replay.Reply) bool {
	for _, r := range reps {
		if r.Status != "SUCCESS" {
			return false
		}
	}
	return len(reps) > 0
}

// clipLine shortens a log line for a test log.
func clipLine(s string) string {
	if len(s) > 400 {
		return s[:400] + "..."
	}
	return s
}

// TestFaultConsumerTimeoutNoRecord: a worker without the record
// (ONCELER_NO_RECORD) runs a task (demo.sleep, 8 s) longer than
// consumer_timeout. There is no record for a redelivery to answer from, so
// the run answers SUCCESS itself (its ack refused); the test ends as soon as
// the caller is answered.
func TestFaultConsumerTimeoutNoRecord(t *testing.T) {
	faultTests(t)
	rb := consumerTimeoutNode(t)
	e := replay.NewEnv(t, replay.Config{Binary: ownBin, AMQPURL: rb.url})
	migrate(t, e)
	w := e.StartWorker(replay.WorkerOptions{NoRecord: true})

	m := e.Message(demo.TaskSleep, testkit.NewID(), []any{"norec-" + testkit.NewID(), 8.0}, nil)
	e.Publish(m)

	answered := e.WaitReplies([]string{m.ID}, 1, 30*time.Second)
	log := w.Log()
	done, lost := strings.Count(log, "sleep done"), strings.Count(log, "delivery lost while the task ran")
	t.Logf("replies %v; runs done %d, of which reported their delivery lost %d", e.Replies(m.ID), done, lost)
	if !answered {
		t.Errorf("caller of a task that succeeded %d times (each past consumer_timeout, without a record) not answered in 30 s", done)
	}
}
