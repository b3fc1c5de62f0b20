package integration

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/internal/testkit"
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

func sqsScenarios() []replay.Scenario { return queueScenarios(sqsKilledPastVisibility) }

// TestSQSReplay replays a Celery task and a plain-message task through SQS
// to onceler workers (--sqs): the same message three times, two workers at
// once, a worker killed (kill -9) after the claim, after the effect, and
// while the message waits unstarted (it comes back past its visibility
// timeout), each kill followed by the producer sending the operation again;
// and many distinct operations. With the record every operation has the
// effect count the Celery suite guarantees (replay.Expect) and the queue
// empties; with --no-record each scenario shows a duplicate effect.
func TestSQSReplay(t *testing.T) {
	runQueueReplay(t, sqsTargets(), func(tg sqsTarget) string { return tg.name }, sqsScenarios(), sqsReplay)
}

// sqsRun sends a target's operations through SQS.
type sqsRun struct {
	e  *sqsEnv
	tg sqsTarget
}

// send sends one message per operation (Celery: task id fixed per
// operation, so that a second send is the same message).
func (r *sqsRun) send(ops ...string) {
	r.e.t.Helper()
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

// sendSlow sends a demo.sleep of d seconds, named after prefix.
func (r *sqsRun) sendSlow(prefix string, d int) {
	args := []any{prefix + "-slow", d}
	if r.tg.celery {
		r.e.celery([]sqsCall{{Task: demo.TaskSleep, Args: args}}, 0)
		return
	}
	r.e.plain(r.plainMessage(demo.TaskSleep, args))
}

func sqsReplay(t *testing.T, tg sqsTarget, s replay.Scenario, noRecord bool) {
	e := newSQSEnv(t, sqsEnvOptions{NoRedis: true})
	sr := &sqsRun{e: e, tg: tg}
	// afterKill starts another worker and sends the operation again (a
	// producer whose call timed out); the killed worker's messages come
	// back when their visibility timeouts run out.
	afterKill := func(r *queueRun, _ *skWorker) {
		r.worker(sqsWorkerOptions{})
		sr.send(r.ops[0])
	}
	r := &queueRun{t: t, e: &e.queueEnv, tg: tg.skTarget, noRecord: noRecord, prefix: testkit.Name("sqr")}
	r.tr = queueTransport{items: "messages", idleName: "queue", idle: e.idle, startWorker: e.startWorker,
		send: func(ops []string, _ bool) { sr.send(ops...) },
		own:  sqsKilledPastVisibility,
		runOwn: func(r *queueRun) {
			w1 := r.worker(sqsWorkerOptions{Concurrency: 1, Prefetch: 2})
			r.ops = []string{r.op(0)}
			sr.sendSlow(r.prefix, 5)
			sr.send(r.op(0))
			testkit.WaitFor(t, "both messages in flight", 30*time.Second, func() bool {
				_, inFlight := e.counts()
				return inFlight == 2
			})
			w1.Kill()
			// Unlike RabbitMQ, where a dead consumer's deliveries go back
			// at once, the messages stay in flight until their visibility
			// timeout runs out.
			if _, inFlight := e.counts(); inFlight != 2 {
				t.Errorf("just after the kill: %d in flight, want 2", inFlight)
			}
			afterKill(r, w1)
		},
		afterKill: afterKill,
		setAside: func(t *testing.T) {
			if n := e.depth(sqsQuarantineOf(e.queue)); n != 0 {
				t.Errorf("quarantine queue holds %d, want 0", n)
			}
		},
	}
	r.run(s)
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
