package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/internal/testkit"
	"github.com/onceler/onceler/internal/workerhooks"
	"github.com/onceler/onceler/tasks"
)

// rabbitCluster is private RabbitMQ nodes of the test's own joined in one
// cluster (each with its own node name, ports and data directory, as
// privateRabbit), stopped and removed when the test ends.
type rabbitCluster struct {
	nodes []*privateRabbit
}

// startRabbitCluster starts n private nodes and joins the others to the
// first (rabbitmqctl stop_app, join_cluster, start_app), then checks with
// cluster_status that every node runs in the cluster.
func startRabbitCluster(t *testing.T, n int) *rabbitCluster {
	t.Helper()
	c := &rabbitCluster{}
	for range n {
		c.nodes = append(c.nodes, newRabbit(t, rabbitOptions{}))
	}
	for _, r := range c.nodes {
		r.await(t)
	}
	first := c.nodes[0]
	for _, r := range c.nodes[1:] {
		r.mustCtl(t, "stop_app")
		r.mustCtl(t, "join_cluster", first.node)
		r.mustCtl(t, "start_app")
		r.mustCtl(t, "await_startup")
	}
	if running := c.running(t, first); len(running) != n {
		t.Fatalf("cluster_status of %s: running nodes %v, want all %d", first.node, running, n)
	}
	return c
}

// running returns the nodes that cluster_status, asked of r, says run.
func (c *rabbitCluster) running(t *testing.T, r *privateRabbit) []string {
	t.Helper()
	out, err := r.ctl("-q", "cluster_status", "--formatter", "json")
	if err != nil {
		t.Fatalf("cluster_status: %v\n%s", err, out)
	}
	var st struct {
		Running []string `json:"running_nodes"`
	}
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatalf("cluster_status: %v\n%s", err, out)
	}
	return st.Running
}

// queuesCtl runs rabbitmq-queues against node r.
func (r *privateRabbit) queuesCtl(t *testing.T, args ...string) {
	t.Helper()
	out, err := runCtl([]string{"runuser", "-u", "rabbitmq", "--", "env", "HOME=/var/lib/rabbitmq", "rabbitmq-queues", "-n", r.node}, args...)
	if err != nil {
		t.Fatalf("rabbitmq-queues: %v\n%s", err, out)
	}
}

// leader returns the node that leads quorum queue q, as r sees it.
func (c *rabbitCluster) leader(t *testing.T, r *privateRabbit, q string) *privateRabbit {
	t.Helper()
	out, err := r.ctl("-q", "list_queues", "name", "leader", "--formatter", "json")
	if err != nil {
		t.Fatalf("list_queues: %v\n%s", err, out)
	}
	var qs []struct{ Name, Leader string }
	if err := json.Unmarshal([]byte(out), &qs); err != nil {
		t.Fatalf("list_queues: %v\n%s", err, out)
	}
	for _, x := range qs {
		if x.Name != q {
			continue
		}
		for _, n := range c.nodes {
			if n.node == x.Leader {
				return n
			}
		}
		t.Fatalf("queue %s: leader %q is no node of the cluster", q, x.Leader)
	}
	t.Fatalf("queue %s not listed:\n%s", q, out)
	return nil
}

// moveLeader moves the leadership of quorum queue q off node r, which
// declared it (client-local placement): r's member is removed, so that
// the others elect a leader, then added back as a follower. It returns the
// new leader.
func (c *rabbitCluster) moveLeader(t *testing.T, r *privateRabbit, q string) *privateRabbit {
	t.Helper()
	r.queuesCtl(t, "delete_member", "-p", "/", q, r.node)
	var l *privateRabbit
	if !testkit.Eventually(time.Minute, func() bool { l = c.leader(t, r, q); return l != r }) {
		t.Fatalf("queue %s: still led by %s", q, r.node)
	}
	r.queuesCtl(t, "add_member", "-p", "/", q, r.node)
	return l
}

// urls returns the cluster's failover list (Celery's ';'-separated
// broker_url) beginning with node first, then the others in order.
func (c *rabbitCluster) urls(first int) string {
	var us []string
	for i := range c.nodes {
		us = append(us, c.nodes[(first+i)%len(c.nodes)].url)
	}
	return strings.Join(us, ";")
}

// clusterKinds are the operations of the cluster tests: same database
// (exactly once by the record's transaction) and outside with the lookup
// policy (exactly once by asking the outside system).
var clusterKinds = []struct{ task, label string }{
	{demo.TaskCredit, "same database"},
	{demo.TaskCharge, "outside, policy lookup"},
}

// clusterOpsPerKind is how many operations of each kind the cluster tests
// send.
const clusterOpsPerKind = 5000

// TestFaultClusterNodeStopped runs two workers against a 3-node RabbitMQ
// cluster (quorum work queue), each connected first to a different node
// and given the whole cluster as its failover list. With a fifth of 5,000
// same-database and 5,000 outside (lookup) operations answered, the node
// worker A is connected to, which also leads the queue, stops (rabbitmqctl
// stop_app) and, once A consumes from another node, starts again: every
// operation takes effect exactly once and every caller is answered; none
// is lost.
func TestFaultClusterNodeStopped(t *testing.T) {
	clusterDrain(t, "stop_app")
}

// TestFaultClusterNodeKilled is TestFaultClusterNodeStopped with the node's
// Erlang VM killed (kill -9: no shutdown, its connections cut without a
// close) and the node started again, rejoining the cluster from its data
// directory.
func TestFaultClusterNodeKilled(t *testing.T) {
	clusterDrain(t, "kill")
}

// clusterDrain is the two cluster tests: fault is "stop_app" or "kill".
//
// Callers' results use the rpc:// backend: the reply queue is a classic
// queue on the node the test's own connection uses (the third node), which
// is never stopped, so a result a worker published and the broker
// confirmed before the fault stays there; a worker whose node went away
// publishes through the node it fails over to. (A Redis result backend
// would take the reply path out of the broker altogether; rpc:// keeps it
// in the cluster under test.)
func clusterDrain(t *testing.T, fault string) {
	faultTests(t)
	began := time.Now()
	cl := startRabbitCluster(t, 3)
	started := time.Since(began)
	stable := cl.nodes[2]
	e := replay.NewEnv(t, replay.Config{Binary: ownBin, AMQPURL: stable.url, Quorum: true})
	migrate(t, e)
	// The node that goes away leads the work queue: the queue elects a new
	// leader while worker A fails over.
	victim := cl.moveLeader(t, stable, e.Queue)
	vi := slices.Index(cl.nodes, victim)
	other := cl.nodes[1-vi]
	wl := newWorkload(e)
	wl.ctl = stable.ctl
	pubStart := time.Now()
	for i := range clusterOpsPerKind {
		for _, k := range clusterKinds {
			wl.send(k.task, wl.op("cluster-"+fault+"-"+k.task, i))
		}
	}
	published := time.Since(pubStart)
	total := clusterOpsPerKind * len(clusterKinds)
	opts := replay.WorkerOptions{Concurrency: 8}
	opts.BrokerURL = cl.urls(vi)
	a := e.StartWorker(opts)
	opts.BrokerURL = cl.urls(1 - vi)
	b := e.StartWorker(opts)
	drainStart := time.Now()
	if !consumingFrom(a, victim) || !consumingFrom(b, other) {
		t.Fatalf("worker A should consume from %s and B from %s:\n%s\n%s", victim.url, other.url, a.LogTail(2000), b.LogTail(2000))
	}
	if !testkit.Eventually(5*time.Minute, func() bool { return wl.answered() >= total/5 }) {
		t.Fatalf("%d of %d answered after 5 minutes", wl.answered(), total)
	}
	at := wl.answered()
	faultAt := time.Now()
	switch fault {
	case "stop_app":
		victim.mustCtl(t, "stop_app")
	case "kill":
		pid := victim.kill(t)
		t.Logf("kill -9 %d: the Erlang VM of %s", pid, victim.node)
	}
	// A fails over: it consumes again, from another node.
	if !testkit.Eventually(2*time.Minute, func() bool { return consumingElsewhere(a, victim) }) {
		t.Fatalf("worker A does not consume from another node 2 minutes after the fault:\n%s", a.LogTail(4000))
	}
	failover := time.Since(faultAt)
	switch fault {
	case "stop_app":
		victim.mustCtl(t, "start_app")
		victim.mustCtl(t, "await_startup")
	case "kill":
		_ = os.Remove(victim.pidFile())
		victim.launch(t)
		victim.await(t)
	}
	back := time.Since(faultAt)
	newLeader := cl.leader(t, stable, e.Queue)
	if running := cl.running(t, stable); len(running) != 3 {
		t.Errorf("after the restart, cluster_status: running %v, want 3 nodes", running)
	}
	if !wl.wait(10 * time.Minute) {
		t.Errorf("%d of %d calls answered 10 minutes after the fault", wl.answered(), total)
	}
	drained := time.Since(drainStart)
	if a.Exited() || b.Exited() {
		t.Errorf("a worker exited: A %s, B %s", a.State(), b.State())
	}
	if !strings.Contains(a.Log(), "the next connection attempt goes to the next URL") {
		t.Errorf("worker A's log does not say it moved on to the next URL:\n%s", a.LogTail(3000))
	}
	wl.stopWorkers()
	byTask := wl.checkByTask(t)
	var sum tally
	table := []string{fmt.Sprintf("%-22s %-24s %10s %8s %10s %5s %8s", "task", "kind", "operations", "effects", "duplicates", "lost", "answered")}
	for _, k := range clusterKinds {
		tl := byTask[k.task]
		if tl == nil {
			tl = &tally{}
		}
		sum.add(*tl)
		table = append(table, fmt.Sprintf("%-22s %-24s %10d %8d %10d %5d %8d", k.task, k.label, tl.ops, tl.effects, tl.duplicates, tl.lost, tl.answered))
	}
	table = append(table, fmt.Sprintf("%-22s %-24s %10d %8d %10d %5d %8d", "total", "", sum.ops, sum.effects, sum.duplicates, sum.lost, sum.answered))
	if sum.ops != total || sum.effects != total || sum.duplicates != 0 || sum.lost != 0 || sum.answered != sum.calls || sum.held != 0 {
		t.Errorf("want %d operations, %d effects, none done twice, none lost, none held, every caller answered: %s", total, total, sum)
	}
	if at >= total {
		t.Errorf("the fault came after every call was answered (%d)", at)
	}
	t.Logf("3-node cluster started in %s; %d operations published in %s; %s on %s (worker A's node, the queue's leader) with %d of %d answered; worker A consuming elsewhere after %s, node back after %s, queue led by %s; drained in %s\n%s",
		started.Round(time.Millisecond), total, published.Round(time.Millisecond), fault, victim.node, at, total,
		failover.Round(time.Millisecond), back.Round(time.Millisecond), newLeader.node, drained.Round(time.Millisecond), strings.Join(table, "\n"))
}

// consumingFrom waits (a minute at most) until w's log says it consumes
// from node r.
func consumingFrom(w *replay.Worker, r *privateRabbit) bool {
	return testkit.Eventually(time.Minute, func() bool { return slices.Contains(consumingBrokers(w), portOf(r)) })
}

// consumingElsewhere reports whether w's last "consuming" line names a
// node other than r.
func consumingElsewhere(w *replay.Worker, r *privateRabbit) bool {
	bs := consumingBrokers(w)
	return len(bs) > 0 && bs[len(bs)-1] != portOf(r)
}

// portOf is the AMQP port of r, as the worker's log shows it.
func portOf(r *privateRabbit) string { return fmt.Sprintf("127.0.0.1:%d", r.port) }

// consumingBrokers returns, in order, the broker address (host:port) of
// each "consuming" line of w's JSON log.
func consumingBrokers(w *replay.Worker) []string {
	var out []string
	for _, line := range strings.Split(w.Log(), "\n") {
		if !strings.Contains(line, `"consuming"`) {
			continue
		}
		var l struct {
			Msg    string `json:"msg"`
			Broker string `json:"broker"`
		}
		if json.Unmarshal([]byte(line), &l) != nil || l.Msg != "consuming" {
			continue
		}
		if _, rest, ok := strings.Cut(l.Broker, "@"); ok {
			host, _, _ := strings.Cut(rest, "/")
			out = append(out, host)
		}
	}
	return out
}

// TestFaultClusterDeliveryLimit sends a same-database task that kills its
// worker every time (crash injection after the claim; a new worker started
// after each death) to a quorum queue declared, as kombu's
// queue_arguments would, with a delivery limit (x-delivery-limit). RabbitMQ
// stamps each redelivery with x-delivery-count and drops the message when
// it returns after the delivery whose count reaches the limit. The worker
// reads both: on that last delivery it does not run the message but
// republishes it with the deliveries so far (x-onceler-deliveries) and
// acknowledges the delivery, so the broker never drops it; past its own
// MaxAttempts (5), counting the carried deliveries, it quarantines the
// message as poison and answers its caller with WorkerLostError; nothing
// is dropped unanswered, no effect.
// A quorum queue works on one node: this runs on the shared broker, on a
// queue of its own.
func TestFaultClusterDeliveryLimit(t *testing.T) {
	faultTests(t)
	const maxAttempts = 5 // the worker's default
	for _, c := range []struct {
		name           string
		limit, crashes int
		detail         string
	}{
		// Deliveries with x-delivery-count 0, 1 and 2 crash; the one with 3
		// is RabbitMQ's last: republished carrying 4 deliveries. The copy's
		// deliveries 0 and 1 (5 and 6 in all) crash; its delivery 2 (7th,
		// more than 5 before it) is quarantined.
		{"limit_3", 3, maxAttempts, "4 of them before it was republished"},
		// MaxAttempts comes first: quarantined when delivered more than 5
		// times (x-delivery-count 6), as without a limit.
		{"limit_10", 10, maxAttempts + 1, "limit 5"},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := replay.NewEnv(t, replay.Config{Binary: ownBin, Quorum: true,
				QueueArgs: map[string]any{"x-delivery-limit": int32(c.limit)}})
			migrate(t, e)
			op := opName(testkit.NewID()[:8], 0)
			m := e.Message(demo.TaskCredit, testkit.NewID(), args(demo.TaskCredit, op), nil)
			e.Publish(m)
			crashes := 0
			quarantined := func() bool { n, err := e.QueueDepth(e.Quarantine); return err == nil && n > 0 }
			for {
				w := e.StartWorker(replay.WorkerOptions{CrashAt: workerhooks.AfterClaim, CrashTask: demo.TaskCredit,
					Concurrency: 1, Prefetch: 1, NoWait: true})
				if !testkit.Eventually(30*time.Second, func() bool { return w.Exited() || quarantined() }) {
					t.Fatalf("worker %s neither crashed nor quarantined the message", w.Name)
				}
				if !w.Exited() {
					break
				}
				crashes++
				if crashes > 2*maxAttempts {
					t.Fatalf("%d crashes: the poison message loops", crashes)
				}
				if crashes > c.limit && !testkit.Eventually(5*time.Second, func() bool {
					n, err := e.QueueDepth(e.Queue)
					return quarantined() || err == nil && n > 0
				}) {
					t.Fatalf("after %d crashes the queue dropped the message (x-delivery-limit %d) and nothing quarantined it", crashes, c.limit)
				}
			}
			if !e.WaitReplies([]string{m.ID}, 1, 30*time.Second) {
				t.Errorf("caller not answered: %v", e.Replies(m.ID))
			}
			time.Sleep(time.Second)
			e.StopAll()
			q, err := e.TakeQuarantined()
			if err != nil || len(q) != 1 || q[0].Reason != tasks.ReasonPoison || q[0].TaskID != m.ID || !strings.Contains(q[0].Detail, c.detail) {
				t.Errorf("quarantine %+v (err %v), want the message as poison, detail naming %q", q, err, c.detail)
			}
			if reps := e.Replies(m.ID); len(reps) != 1 || reps[0].Status != "FAILURE" || reps[0].ExcType != "WorkerLostError" {
				t.Errorf("caller got %v, want one FAILURE WorkerLostError", reps)
			}
			if n, err := demo.CountLedger(context.Background(), e.Pool, op); err != nil || n != 0 {
				t.Errorf("%d effects (err %v), want 0", n, err)
			}
			if d, err := e.QueueDepth(e.Queue); err != nil || d != 0 {
				t.Errorf("queue depth %d (err %v)", d, err)
			}
			if crashes != c.crashes {
				t.Errorf("quarantined after %d crashes, want %d (x-delivery-limit %d, MaxAttempts %d)", crashes, c.crashes, c.limit, maxAttempts)
			}
			t.Logf("x-delivery-limit %d: quarantined as poison after %d crashes (%s); caller answered %s %s",
				c.limit, crashes, q0detail(q), e.Replies(m.ID)[0].Status, e.Replies(m.ID)[0].ExcType)
		})
	}
}

func q0detail(q []replay.Quarantined) string {
	if len(q) == 0 {
		return "nothing quarantined"
	}
	return q[0].Detail
}
