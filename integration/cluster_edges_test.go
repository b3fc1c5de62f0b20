package integration

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/internal/testkit"
	"github.com/onceler/onceler/internal/workerhooks"
)

// TestFaultDeliveryLimitZero: a quorum queue declared with
// x-delivery-limit 0, which RabbitMQ (3.10) takes as "no redelivery": the
// first delivery is the last, and a message that returns once is dropped.
// No worker can keep such a message should it die running it (the
// delivery-limit handling republishes a message on its last delivery
// instead of running it: with limit 0 it would never run), so the worker
// refuses the queue at start in one line, and the message stays in the
// queue unrun, for a queue with a usable limit. A worker that consumed it
// (reading 0 as "no limit", as it once did) would have it dropped
// unanswered by its first crash.
func TestFaultDeliveryLimitZero(t *testing.T) {
	faultTests(t)
	e := replay.NewEnv(t, replay.Config{Binary: ownBin, Quorum: true,
		QueueArgs: map[string]any{"x-delivery-limit": int32(0)}})
	migrate(t, e)
	op := opName(testkit.NewID()[:8], 0)
	m := e.Message(demo.TaskCredit, testkit.NewID(), args(demo.TaskCredit, op), nil)
	e.Publish(m)
	w := e.StartWorker(replay.WorkerOptions{CrashAt: workerhooks.AfterClaim, CrashTask: demo.TaskCredit,
		Concurrency: 1, Prefetch: 1, NoWait: true})
	if !testkit.Eventually(30*time.Second, w.Exited) {
		t.Fatalf("worker %s consumes a queue with x-delivery-limit 0:\n%s", w.Name, w.LogTail(2000))
	}
	if !strings.Contains(w.Log(), "x-delivery-limit 0 drops any message whose worker dies; raise it") {
		t.Errorf("worker exited without naming the delivery limit 0:\n%s", w.LogTail(2000))
	}
	if n, err := e.QueueDepth(e.Queue); err != nil || n != 1 {
		t.Errorf("queue depth %d (err %v), want the message still there", n, err)
	}
	if n, err := demo.CountLedger(context.Background(), e.Pool, op); err != nil || n != 0 {
		t.Errorf("%d effects (err %v), want 0", n, err)
	}
}

// TestFaultClusterQuarantineQueueNodeDown: a 3-node cluster, the work
// queue a quorum queue (replicated). A worker connected first to node 0
// declares the work queue's quarantine queue there (a classic one would
// live on node 0 only). Node 0 stops (stop_app). A worker started now with the
// cluster's failover list (node 0 first) must fail over to node 1 and
// consume the quorum queue, whose messages are all there. Declaring the
// quarantine queue on node 1 must not be refused (a classic quarantine
// queue whose home node is down answers 404, and the worker would exit at
// start): it is declared with its work queue's type, quorum. (A worker already running when node
// 0 stops was seen to keep going, its quarantined message found in the
// quarantine queue once node 0 was back.)
func TestFaultClusterQuarantineQueueNodeDown(t *testing.T) {
	faultTests(t)
	cl := startRabbitCluster(t, 3)
	stable, victim := cl.nodes[1], cl.nodes[0]
	e := replay.NewEnv(t, replay.Config{Binary: ownBin, AMQPURL: stable.url, Quorum: true})
	migrate(t, e)
	a := e.StartWorker(replay.WorkerOptions{BrokerURL: cl.urls(0)})
	if !consumingFrom(a, victim) {
		t.Fatalf("worker A should consume from %s:\n%s", victim.url, a.LogTail(2000))
	}
	a.Stop()
	victim.mustCtl(t, "stop_app")
	t.Cleanup(func() { _, _ = victim.ctl("start_app") })
	b := e.StartWorker(replay.WorkerOptions{BrokerURL: cl.urls(0), NoWait: true})
	ok := testkit.Eventually(90*time.Second, func() bool { return b.Exited() || consumingElsewhere(b, victim) })
	if b.Exited() || !ok {
		line := ""
		for _, l := range strings.Split(b.Log(), "\n") {
			if strings.Contains(l, "declare quarantine queue") || strings.Contains(l, "home node") {
				line = l
			}
		}
		t.Fatalf("worker B did not consume the quorum queue from %s with %s down (%s): %s", stable.node, victim.node, b.State(), line)
	}
	m := e.Message(demo.TaskCredit, testkit.NewID(), args(demo.TaskCredit, opName(testkit.NewID()[:8], 0)), nil)
	e.Publish(m)
	if !e.WaitReplies([]string{m.ID}, 1, 30*time.Second) {
		t.Errorf("caller not answered: %v", e.Replies(m.ID))
	}
}
