package integration

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/internal/testkit"
	"github.com/onceler/onceler/internal/workerhooks"
)

// sqsTarget is a demo task replayed through SQS, sent by a Celery 5.2.6
// producer (kombu's SQS transport) or as plain messages (boto3).
type sqsTarget struct {
	name   string
	celery bool
	skTarget
}

func sqsTargets() []sqsTarget {
	sk := skTargets()
	return []sqsTarget{
		{name: "celery_" + sk[0].task, celery: true, skTarget: sk[0]}, // demo.ledger.credit: same database
		{name: "plain_" + sk[1].task, skTarget: sk[1]},                // demo.payments.charge: outside, lookup
	}
}

// sqsKilledPastVisibility: a worker killed while the operation's message
// waits unstarted behind a slow task; the message comes back only when its
// visibility timeout runs out.
const sqsKilledPastVisibility replay.Scenario = "killed_past_visibility"

func sqsScenarios() []replay.Scenario {
	return []replay.Scenario{replay.ScenarioRepeated, replay.ScenarioConcurrent, replay.ScenarioCrashAfterClaim,
		replay.ScenarioCrashAfterEffect, sqsKilledPastVisibility, replay.ScenarioMany}
}

// TestSQSReplay replays a Celery task and a plain-message task through SQS
// to onceler workers (--sqs): the same message three times, two workers at
// once, a worker killed (kill -9) after the claim, after the effect, and
// while the message waits unstarted (it comes back past its visibility
// timeout), each kill followed by the producer sending the operation again;
// and many distinct operations. With the record every operation has the
// effect count the Celery suite guarantees (replay.Expect) and the queue
// empties; with --no-record each scenario shows a duplicate effect.
func TestSQSReplay(t *testing.T) {
	t.Parallel()
	for _, tg := range sqsTargets() {
		t.Run(tg.name, func(t *testing.T) {
			t.Parallel()
			for _, s := range sqsScenarios() {
				t.Run(string(s), func(t *testing.T) {
					t.Run("record", func(t *testing.T) { sqsReplay(t, tg, s, false) })
					t.Run("no_record", func(t *testing.T) { sqsReplay(t, tg, s, true) })
				})
			}
		})
	}
}

type sqsRun struct {
	t        *testing.T
	e        *sqsEnv
	tg       sqsTarget
	noRecord bool
	prefix   string
	ops      []string
}

// send sends one message per operation (Celery: task id fixed per
// operation, so that a second send is the same message).
func (r *sqsRun) send(ops ...string) {
	r.t.Helper()
	if r.tg.celery {
		calls := make([]sqsCall, len(ops))
		for i, op := range ops {
			calls[i] = sqsCall{Task: r.tg.task, Args: r.tg.args(op), ID: "id-" + op}
		}
		r.e.celery(calls, 0)
		return
	}
	msgs := make([]sqsMessage, len(ops))
	for i, op := range ops {
		msgs[i] = r.plainMessage(r.tg.task, r.tg.args(op))
	}
	r.e.plain(msgs...)
}

func (r *sqsRun) plainMessage(task string, args []any) sqsMessage {
	b := "["
	for i, a := range args {
		if i > 0 {
			b += ", "
		}
		if s, ok := a.(string); ok {
			b += strconv.Quote(s)
		} else {
			b += fmt.Sprint(a)
		}
	}
	return sqsMessage{Body: b + "]", Attributes: map[string]string{"task": task}}
}

// sendSlow sends a demo.sleep of d seconds.
func (r *sqsRun) sendSlow(d int) {
	args := []any{r.prefix + "-slow", d}
	if r.tg.celery {
		r.e.celery([]sqsCall{{Task: demo.TaskSleep, Args: args}}, 0)
		return
	}
	r.e.plain(r.plainMessage(demo.TaskSleep, args))
}

func (r *sqsRun) worker(o sqsWorkerOptions) *skWorker {
	o.NoRecord = r.noRecord
	return r.e.startWorker(o)
}

func sqsReplay(t *testing.T, tg sqsTarget, s replay.Scenario, noRecord bool) {
	r := &sqsRun{t: t, e: newSQSEnv(t, sqsEnvOptions{NoRedis: true}), tg: tg, noRecord: noRecord, prefix: testkit.Name("sqr")}
	op := func(i int) string { return fmt.Sprintf("%s-%d", r.prefix, i) }
	start := time.Now()
	switch s {
	case replay.ScenarioRepeated:
		r.worker(sqsWorkerOptions{})
		var ops []string
		for i := range 3 {
			r.ops = append(r.ops, op(i))
			ops = append(ops, op(i), op(i), op(i))
		}
		r.send(ops...)
	case replay.ScenarioConcurrent:
		r.worker(sqsWorkerOptions{})
		r.worker(sqsWorkerOptions{})
		var ops []string
		for i := range 5 {
			r.ops = append(r.ops, op(i))
			ops = append(ops, op(i), op(i))
		}
		r.send(ops...)
	case replay.ScenarioCrashAfterClaim, replay.ScenarioCrashAfterEffect:
		at := workerhooks.AfterClaim
		if s == replay.ScenarioCrashAfterEffect {
			at = workerhooks.AfterEffect
		}
		w1 := r.worker(sqsWorkerOptions{CrashAt: at, CrashTask: tg.task, Concurrency: 1, Prefetch: 1})
		r.ops = []string{op(0)}
		r.send(op(0))
		if !testkit.Eventually(60*time.Second, w1.Exited) || !w1.Crashed() {
			t.Fatalf("worker armed with %s did not crash: %s", at, w1.LogTail(3000))
		}
		r.afterKill()
	case sqsKilledPastVisibility:
		w1 := r.worker(sqsWorkerOptions{Concurrency: 1, Prefetch: 2})
		r.ops = []string{op(0)}
		r.sendSlow(5)
		r.send(op(0))
		testkit.WaitFor(t, "both messages in flight", 30*time.Second, func() bool {
			_, inFlight := r.e.counts()
			return inFlight == 2
		})
		w1.Kill()
		// Unlike RabbitMQ, where a dead consumer's deliveries go back at
		// once, the messages stay in flight until their visibility
		// timeout runs out.
		if _, inFlight := r.e.counts(); inFlight != 2 {
			t.Errorf("just after the kill: %d in flight, want 2", inFlight)
		}
		r.afterKill()
	case replay.ScenarioMany:
		r.worker(sqsWorkerOptions{})
		r.worker(sqsWorkerOptions{})
		var ops []string
		for i := range 30 {
			r.ops = append(r.ops, op(i))
			ops = append(ops, op(i))
			if i%5 == 4 {
				ops = append(ops, op(i-2))
			}
		}
		r.send(ops...)
	}
	r.check(s, start)
}

// afterKill starts another worker and sends the operation again (a
// producer whose call timed out); the killed worker's messages come back
// when their visibility timeouts run out.
func (r *sqsRun) afterKill() {
	r.worker(sqsWorkerOptions{})
	r.send(r.ops[0])
}

// counts are the test queue's ApproximateNumberOfMessages (SQS: those
// visible; goaws: all) and ApproximateNumberOfMessagesNotVisible (in
// flight).
func (e *sqsEnv) counts() (visible, inFlight int) { return e.countsOf(e.queue) }

// countsOf is counts of the queue named q.
func (e *sqsEnv) countsOf(q string) (visible, inFlight int) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	u, err := e.client.QueueURL(ctx, q)
	if err != nil {
		return -1, -1
	}
	out, err := e.client.API().GetQueueAttributes(ctx, &awssqs.GetQueueAttributesInput{QueueUrl: aws.String(u),
		AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameApproximateNumberOfMessages,
			types.QueueAttributeNameApproximateNumberOfMessagesNotVisible}})
	if err != nil {
		return -1, -1
	}
	visible, _ = strconv.Atoi(out.Attributes["ApproximateNumberOfMessages"])
	inFlight, _ = strconv.Atoi(out.Attributes["ApproximateNumberOfMessagesNotVisible"])
	return visible, inFlight
}

func (r *sqsRun) check(s replay.Scenario, start time.Time) {
	t, e := r.t, r.e
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	want := replay.Expect(s, r.tg.mode, r.tg.policy)
	if s == sqsKilledPastVisibility {
		want = replay.Expect(replay.ScenarioRepeated, r.tg.mode, r.tg.policy)
	}
	done := func() bool {
		if !e.idle() {
			return false
		}
		if r.noRecord {
			return true
		}
		for _, op := range r.ops {
			rec, err := e.store.Get(ctx, r.tg.task, op)
			if err != nil || rec.Status != want.Status {
				return false
			}
		}
		return true
	}
	if !testkit.Eventually(90*time.Second, done) {
		t.Errorf("messages not all settled within 90s (queue idle %v)", e.idle())
	}
	time.Sleep(500 * time.Millisecond)
	e.stopAll()
	if n := e.depth(sqsQuarantineOf(e.queue)); n != 0 {
		t.Errorf("quarantine queue holds %d, want 0", n)
	}
	counts := make([]int, len(r.ops))
	for i, op := range r.ops {
		n, err := r.tg.effects(ctx, e.pool, op)
		if err != nil {
			t.Fatalf("count effects of %s: %v", op, err)
		}
		counts[i] = n
	}
	if r.noRecord {
		dup := 0
		for _, n := range counts {
			if n > 1 {
				dup++
			}
		}
		if dup == 0 {
			t.Errorf("without the record, %s showed no duplicate effect (effects per operation %v)", s, counts)
		} else {
			t.Logf("without the record, as expected: %d of %d operations had their effect more than once (max %d)", dup, len(r.ops), slices.Max(counts))
		}
		return
	}
	for i, op := range r.ops {
		if counts[i] != want.Effects {
			t.Errorf("operation %s: %d effects, want %d (%s, mode %s, policy %s)", op, counts[i], want.Effects, s, r.tg.mode, r.tg.policy)
		}
		rec, err := e.store.Get(ctx, r.tg.task, op)
		if err != nil {
			t.Errorf("operation %s: record: %v", op, err)
		} else if rec.Status != want.Status {
			t.Errorf("operation %s: record %s (%s), want %s", op, rec.Status, rec.Reason, want.Status)
		}
	}
	if want.Takeover {
		var n int64
		stats, err := e.store.Repeats(ctx, start.Add(-time.Minute))
		for _, st := range stats {
			if st.Task == r.tg.task {
				n = st.Takeovers
			}
		}
		if err != nil || n < 1 {
			t.Errorf("takeovers counted: %d (err %v), want at least 1", n, err)
		}
	}
	if n, err := e.store.StaleClaims(ctx); err != nil || n != 0 {
		t.Errorf("stale claims: %d (err %v), want 0", n, err)
	}
}
