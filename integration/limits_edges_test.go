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

// Edges of "a run whose delivery was lost answers nothing; its redelivery
// is answered from the record" (tasks.Worker.lostWhileRunning), on a
// private node with consumer_timeout = 5000 (checked every second).

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
// its record (SUCCESS) and, its delivery lost, sends nothing: neither the
// result nor the chain's step. The redelivery that is to answer from the
// record does not:
//   - "ttl": the message carries the AMQP expiration Celery's apply_async
//     sets from expires (celery/app/base.py: options["expiration"]): the
//     broker drops it when it goes back to the queue past its TTL; there is
//     no redelivery, the caller is never answered;
//   - "header": expires in the header alone: the redelivery reaches the due
//     stage, which answers REVOKED before it looks at the record.
//
// Either way the caller is not told SUCCESS for a task whose effect
// happened, and the chain's next step is never sent.
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
			if len(reps) != 1 || reps[0].Status != "SUCCESS" {
				t.Errorf("the task's effect and SUCCESS are recorded, but its caller got %v, want one SUCCESS", reps)
			}
			if !stepAnswered {
				t.Errorf("the task completed, but the chain's next step %s was never sent", stepID)
			}
		})
	}
}

// TestFaultConsumerTimeoutSlowFailure: a task that fails after running
// longer than consumer_timeout (demo.sleep, 30 s, with a 7 s hard time
// limit: TimeLimitExceeded at 7 s). Its delivery is lost while it runs, so
// it answers nothing; a failure is not answered from the record (a
// same-database failure is rolled back: nothing recorded; the redelivery
// runs the task again), and the rerun fails the same way past
// consumer_timeout and answers nothing either, and so on, until the
// delivery count passes Config.MaxAttempts (5) and the message is
// quarantined as poison: the caller hears, after six or seven runs and
// some 45 s, FAILURE WorkerLostError instead of its task's failure
// (TimeLimitExceeded) after the first. (Celery's worker, and this one
// before, told the caller TimeLimitExceeded at the first run.)
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

	answered := e.WaitReplies([]string{m.ID}, 1, 90*time.Second)
	took := time.Since(sent)
	reps := e.Replies(m.ID)
	log := w.Log()
	lost := strings.Count(log, "delivery lost while the task ran")
	t.Logf("answered %v after %s: %v; runs that reported their delivery lost: %d; consumer_timeout warnings: %d",
		answered, took.Round(time.Second), reps, lost, strings.Count(log, consumerTimeoutWarning))
	if !answered {
		t.Fatalf("caller of a task failing after 7 s not answered in 90 s; %d runs answered nothing", lost)
	}
	if reps[0].ExcType != "TimeLimitExceeded" || took > 25*time.Second {
		t.Errorf("caller told %s after %s and %d runs that answered nothing; want TimeLimitExceeded after the first run (7 s)",
			reps[0].ExcType, took.Round(time.Second), lost)
	}
}

// TestFaultConsumerTimeoutDeliveryLimit: a quorum queue with
// x-delivery-limit 1 and a same-database task (demo.sleep, 8 s) with a
// chain's next step. The broker takes the delivery back at consumer_timeout
// (a return the quorum queue counts); the run commits its effect and its
// record (SUCCESS) and sends nothing. The redelivery, the one meant to be
// answered from the record, is the broker's last (x-delivery-count 1 = the
// limit): the decode stage quarantines it as poison before it looks at the
// record, and tells the caller FAILURE WorkerLostError for a task whose
// effect and SUCCESS are recorded; the chain's next step is never sent.
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
	if len(reps) != 1 || reps[0].Status != "SUCCESS" {
		t.Errorf("the task's effect and SUCCESS are recorded, but its caller got %v, want one SUCCESS", reps)
	}
	if !stepAnswered {
		t.Errorf("the task completed, but the chain's next step %s was never sent", stepID)
	}
}

// TestFaultBrokerRestartTransientMessage: a same-database task (demo.sleep,
// 6 s) sent transient (delivery_mode 1, as with Celery's
// task_default_delivery_mode = "transient") with a chain's next step; the
// broker restarts (stop_app, start_app) while it runs. The worker's channel
// closes with its connection, so the run, which commits its effect and its
// record, sends nothing: "its redelivery is answered from the record". But
// a transient message does not survive the restart: there is no
// redelivery. The caller is never answered and the chain's next step never
// sent (the worker's publisher reconnects: the run could have answered).
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

// clipLine shortens a log line for a test log.
func clipLine(s string) string {
	if len(s) > 400 {
		return s[:400] + "..."
	}
	return s
}

// TestFaultConsumerTimeoutNoRecord: a worker without the record
// (ONCELER_NO_RECORD) runs a task (demo.sleep, 8 s) longer than
// consumer_timeout. Its run succeeds but, its delivery lost, sends nothing:
// the redelivery is to be "answered from the record", but there is none,
// so the redelivery runs the task again, 8 s, past consumer_timeout again,
// and sends nothing either, and so on: every run succeeds, none answers,
// and no delivery count stops it (Config.MaxAttempts counts in the record).
// (Before, each run answered SUCCESS, its ack refused.)
func TestFaultConsumerTimeoutNoRecord(t *testing.T) {
	faultTests(t)
	rb := consumerTimeoutNode(t)
	e := replay.NewEnv(t, replay.Config{Binary: ownBin, AMQPURL: rb.url})
	migrate(t, e)
	w := e.StartWorker(replay.WorkerOptions{NoRecord: true})

	m := e.Message(demo.TaskSleep, testkit.NewID(), []any{"norec-" + testkit.NewID(), 8.0}, nil)
	e.Publish(m)

	answered := e.WaitReplies([]string{m.ID}, 1, 90*time.Second)
	log := w.Log()
	done, lost := strings.Count(log, "sleep done"), strings.Count(log, "delivery lost while the task ran")
	t.Logf("replies %v; runs done %d, of which reported their delivery lost %d", e.Replies(m.ID), done, lost)
	if !answered {
		t.Errorf("caller of a task that succeeded %d times (each past consumer_timeout, without a record) not answered in 90 s (past where Config.MaxAttempts quarantines a recorded task)", done)
	}
}
