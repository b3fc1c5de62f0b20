package integration

import (
	"strings"
	"testing"
	"time"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/internal/testkit"
)

// The TestFault tests restart or disconnect services: a private RabbitMQ
// node or PostgreSQL server of their own, so nobody else's tests are
// disturbed. They run with ONCELER_FAULT_TESTS=1, in CI's serial fault step
// (they start servers and take a few minutes).

// faultOps is how many operations a service fault test sends; the fault
// comes when a fifth of them are answered.
const faultOps = 1000

// completedOnce asserts, beyond the per-task guarantees check asserts (one
// effect per operation, a record completed, every caller answered SUCCESS,
// queue and quarantine empty, no stale claim), that the fault hit the
// middle of the stream, that no operation was lost, done twice beyond its
// policy (replay.notify, policy retry, may run twice and is counted) or left
// held, and that every caller was answered. outsideDown allows an outside
// task whose simulated outside system (in the restarted database) failed
// the call: its caller is told, its record says failed, no effect.
func completedOnce(t *testing.T, tl tally, answeredAtFault int, outsideDown bool) {
	t.Helper()
	if tl.ops != faultOps || answeredAtFault >= faultOps {
		t.Errorf("%d operations, %d answered when the fault came: want %d operations and the fault mid-stream", tl.ops, answeredAtFault, faultOps)
	}
	if tl.lost != 0 || tl.duplicates != 0 || tl.held != 0 || tl.answered != tl.calls {
		t.Errorf("%s: want none lost, none done twice, none held, every caller answered", tl)
	}
	if !outsideDown && tl.outsideFailed != 0 {
		t.Errorf("%d outside operations failed with no fault on their outside system", tl.outsideFailed)
	}
}

// mixed sends n operations over the demo tasks of every mode and the
// replayworker's replay.notify (policy retry).
func mixed(wl *workload, prefix string, n int) {
	kinds := []string{demo.TaskCredit, demo.TaskCharge, demo.TaskCredit, demo.TaskEmail, "replay.notify", demo.TaskSleep}
	for i := range n {
		task := kinds[i%len(kinds)]
		if task == demo.TaskSleep && i%12 != 5 {
			task = demo.TaskCredit // few slow ones
		}
		wl.send(task, wl.op(prefix, i))
	}
}

// finish waits for every call to be answered, re-asking (same task id)
// those whose result may have been lost with the broker, then stops the
// workers once the queue is empty and checks every operation's guarantee.
func finish(t *testing.T, e *replay.Env, wl *workload, reask bool) tally {
	t.Helper()
	if !wl.wait(90 * time.Second) {
		if !reask {
			t.Errorf("%d of %d calls answered", wl.answered(), len(wl.ids()))
		} else {
			n := wl.reask()
			t.Logf("re-asked %d calls whose result did not arrive (as a client does after its timeout)", n)
			if !wl.wait(90 * time.Second) {
				t.Errorf("%d of %d calls answered after re-asking", wl.answered(), len(wl.ids()))
			}
		}
	}
	wl.stopWorkers()
	return wl.check(t)
}

// closeWorkerConnections closes, from the broker, the connections of the
// given workers only (by connection name), and returns how many.
func closeWorkerConnections(t *testing.T, workers ...*replay.Worker) int {
	t.Helper()
	names := make([]string, len(workers))
	for i, w := range workers {
		names[i] = w.Name
	}
	return closeConnections(t, names...)
}

// closeConnections closes, from the broker, the connections whose name
// (a client property) starts with one of the prefixes, and returns how many.
func closeConnections(t *testing.T, prefixes ...string) int {
	t.Helper()
	pids := testkit.ConnectionPIDs(t, prefixes...)
	testkit.CloseConnections(t, pids)
	return len(pids)
}

// TestBrokerResetWorkerConnections closes, from the broker, the test's own
// connections (the workers' and the producer's) in the middle of a mixed
// stream, as close_all_connections does to everyone: the workers
// reconnect; results published while the producer was away wait in its
// reply queue; nothing is lost or done twice; every caller is answered.
func TestBrokerResetWorkerConnections(t *testing.T) {
	e := ownEnv(t)
	w1 := e.StartWorker(replay.WorkerOptions{})
	w2 := e.StartWorker(replay.WorkerOptions{})
	wl := newWorkload(e)
	mixed(wl, "reset", 300)
	testkit.Eventually(time.Minute, func() bool { return wl.answered() >= 60 })
	n := closeConnections(t, w1.Name, w2.Name, "replay-harness-"+e.Queue)
	if n < 3 {
		t.Fatalf("closed %d connections, want the workers' and the producer's (at least 3)", n)
	}
	if err := e.Reconnect(); err != nil {
		t.Fatal(err)
	}
	tl := finish(t, e, wl, false)
	t.Logf("closed %d connections; %s", n, tl)
}

// TestFaultBrokerCloseAllConnections closes every connection of the broker
// (rabbitmqctl close_all_connections, on a private RabbitMQ node)
// mid-stream: the workers reconnect; nothing is lost or done twice.
func TestFaultBrokerCloseAllConnections(t *testing.T) {
	faultTests(t)
	rb := startRabbit(t)
	e := replay.NewEnv(t, replay.Config{Binary: ownBin, AMQPURL: rb.url})
	migrate(t, e)
	e.StartWorker(replay.WorkerOptions{})
	e.StartWorker(replay.WorkerOptions{})
	wl := newWorkload(e)
	mixed(wl, "closeall", faultOps)
	testkit.Eventually(time.Minute, func() bool { return wl.answered() >= faultOps/5 })
	at := wl.answered()
	rb.mustCtl(t, "close_all_connections", "onceler fault test")
	if err := e.Reconnect(); err != nil {
		t.Fatal(err)
	}
	tl := finish(t, e, wl, true)
	completedOnce(t, tl, at, false)
	for _, w := range e.Workers() {
		if !strings.Contains(w.Log(), "consumer disconnected; reconnecting") {
			t.Errorf("worker %s did not reconnect after close_all_connections", w.Name)
		}
	}
	t.Logf("closed all connections with %d of %d answered; %s", at, faultOps, tl)
}

// TestFaultBrokerRestart stops the broker application (rabbitmqctl
// stop_app, on a private RabbitMQ node) for 5 s mid-stream, then starts it
// again: durable queues and persistent messages survive; the workers
// reconnect and finish every operation once. Results in flight when the
// broker stopped are transient (as Celery's): their callers re-ask with the
// same task id and are answered from the record.
func TestFaultBrokerRestart(t *testing.T) {
	faultTests(t)
	rb := startRabbit(t)
	e := replay.NewEnv(t, replay.Config{Binary: ownBin, AMQPURL: rb.url, DurableReplies: true})
	migrate(t, e)
	e.StartWorker(replay.WorkerOptions{})
	e.StartWorker(replay.WorkerOptions{})
	wl := newWorkload(e)
	wl.ctl = rb.ctl
	mixed(wl, "restart", 400)
	testkit.Eventually(time.Minute, func() bool { return wl.answered() >= 80 })
	rb.mustCtl(t, "stop_app")
	time.Sleep(5 * time.Second)
	rb.mustCtl(t, "start_app")
	rb.mustCtl(t, "await_startup")
	if err := e.Reconnect(); err != nil {
		t.Fatal(err)
	}
	tl := finish(t, e, wl, true)
	t.Logf("%s", tl)
}

// TestFaultPostgresRestart restarts PostgreSQL (a private server) in the
// middle of a mixed stream, fast (clean shutdown) and immediate (crash
// recovery): claims in flight are lost with their transactions or kept
// committed; nothing is lost, nothing done twice beyond the policy, nothing
// held. A claim that committed while the restart cut its answer is claimed
// again with the same token and found to be the delivery's own (see
// TestLostClaimAnswer in tasks); before, such a claim could lapse into the
// hold policy of the email task and leave it held.
func TestFaultPostgresRestart(t *testing.T) {
	faultTests(t)
	for _, mode := range []string{"fast", "immediate"} {
		t.Run(mode, func(t *testing.T) {
			pg := startPostgres(t)
			e := replay.NewEnv(t, replay.Config{Binary: ownBin, DatabaseURL: pg.url})
			migrate(t, e)
			e.StartWorker(replay.WorkerOptions{})
			e.StartWorker(replay.WorkerOptions{})
			wl := newWorkload(e)
			wl.outsideDown = true
			mixed(wl, "pg"+mode, faultOps)
			testkit.Eventually(time.Minute, func() bool { return wl.answered() >= faultOps/5 })
			at := wl.answered()
			took := pg.restart(t, mode)
			tl := finish(t, e, wl, false)
			completedOnce(t, tl, at, true)
			t.Logf("restart -m %s with %d of %d answered took %s; %s", mode, at, faultOps, took.Round(time.Millisecond), tl)
		})
	}
}
