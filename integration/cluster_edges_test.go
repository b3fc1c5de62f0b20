package integration

import (
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
// The worker reads 0 as "no limit" (QueueSpec.DeliveryLimit), so a task
// that kills its worker on that first delivery is dropped by the broker
// with its caller never answered: what the delivery-limit handling is
// there to prevent (TestFaultClusterDeliveryLimit for limit 3).
func TestFaultDeliveryLimitZero(t *testing.T) {
	faultTests(t)
	e := replay.NewEnv(t, replay.Config{Binary: ownBin, Quorum: true,
		QueueArgs: map[string]any{"x-delivery-limit": int32(0)}})
	migrate(t, e)
	op := opName(testkit.NewID()[:8], 0)
	m := e.Message(demo.TaskCredit, testkit.NewID(), args(demo.TaskCredit, op), nil)
	e.Publish(m)
	quarantined := func() bool { n, err := e.QueueDepth(e.Quarantine); return err == nil && n > 0 }
	crashes := 0
	for crashes < 3 {
		w := e.StartWorker(replay.WorkerOptions{CrashAt: workerhooks.AfterClaim, CrashTask: demo.TaskCredit,
			Concurrency: 1, Prefetch: 1, NoWait: true})
		if !testkit.Eventually(30*time.Second, func() bool { return w.Exited() || quarantined() }) {
			t.Fatalf("worker %s neither crashed nor quarantined the message", w.Name)
		}
		if !w.Exited() {
			break
		}
		crashes++
		if !testkit.Eventually(5*time.Second, func() bool {
			n, err := e.QueueDepth(e.Queue)
			return quarantined() || err == nil && n > 0
		}) {
			t.Fatalf("after %d crash(es) the queue dropped the message (x-delivery-limit 0) and nothing quarantined it; caller answered: %v",
				crashes, e.Replies(m.ID))
		}
	}
	if !e.WaitReplies([]string{m.ID}, 1, 30*time.Second) {
		t.Errorf("caller not answered: %v", e.Replies(m.ID))
	}
}

// TestFaultClusterQuarantineQueueNodeDown: a 3-node cluster, the work
// queue a quorum queue (replicated). A worker connected first to node 0
// declares the work queue's quarantine queue there: a classic queue, on
// node 0 only. Node 0 stops (stop_app). A worker started now with the
// cluster's failover list (node 0 first) must fail over to node 1 and
// consume the quorum queue, whose messages are all there. Declaring the
// quarantine queue on node 1 is refused (404: its home node is down), and
// the worker exits at start instead. (A worker already running when node
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
