package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/internal/testkit"
)

// TestSidekiqEdgeIdempotencyKeyNotString: a producer that sets the job's
// idempotency_key to a number (an order id, say: Ruby's JSON writes an
// Integer as a number) names the operation as surely as one that sets a
// string. Two jobs pushed with the same numeric key are one operation:
// at most one of them may run (the other is a duplicate or, with other
// arguments, refused), or both are refused as bad input. The worker must
// not drop the key silently and fall back to the task's Key of each
// job's arguments, which runs both.
func TestSidekiqEdgeIdempotencyKeyNotString(t *testing.T) {
	t.Parallel()
	e := newSkEnv(t)
	e.startWorker(skWorkerOptions{})
	entry := testkit.Name("sknumkey")
	a, b := creditJob(entry+"-a"), creditJob(entry+"-b")
	a["idempotency_key"] = 4242
	b["idempotency_key"] = 4242
	e.push(a, b)
	testkit.WaitFor(t, "both jobs settled", time.Minute, e.idle)
	// A moment for a run still writing its row after its settle.
	time.Sleep(200 * time.Millisecond)
	if n := len(ledgerOrder(t, e, entry)); n > 1 {
		t.Errorf("%d ledger rows for two jobs with the same idempotency_key 4242, want at most 1: a numeric idempotency_key is ignored, each job keyed by its arguments", n)
	}
}

// TestSidekiqEdgeHandBacksAreNotPoison: a job that waits in a worker's
// working list (prefetched behind a running job) and is handed back,
// never started, each time the worker stops gracefully (a rolling deploy
// while the queue is backed up: the handed-back job goes to the head of
// its queue and is fetched first again) has killed no worker. Past the
// poison limit of such stops it must still run, not go to the dead set
// as Onceler::Poison: the delivery counter counts graceful hand-backs as
// if each were a crash.
func TestSidekiqEdgeHandBacksAreNotPoison(t *testing.T) {
	t.Parallel()
	e := newSkEnv(t)
	ctx := context.Background()
	op := testkit.Name("skhandback")
	jids := e.push(creditJob(op))
	for i := range 6 { // one more than the poison limit of 5 earlier deliveries
		// A short job at the head of the queue, fetched first and run,
		// so that the credit job waits behind it.
		sleep := map[string]any{"class": demo.TaskSleep, "args": []any{fmt.Sprintf("%s-run%d", op, i), 0.5},
			"jid": fmt.Sprintf("%s-sleep%d", op, i), "queue": e.queue, "retry": true}
		b, _ := json.Marshal(sleep)
		if err := e.rdb.RPush(ctx, "queue:"+e.queue, string(b)).Err(); err != nil {
			t.Fatal(err)
		}
		w := e.startWorker(skWorkerOptions{Concurrency: 1, Prefetch: 2})
		working := "onceler:working:" + w.identity(t) + ":" + e.queue
		testkit.WaitFor(t, "both jobs in the working list", 15*time.Second, func() bool {
			l, err := e.rdb.LRange(ctx, working, 0, -1).Result()
			return err == nil && len(l) == 2 && strings.Contains(strings.Join(l, ""), jids[0])
		})
		if err := w.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		if !w.WaitExit(30 * time.Second) {
			t.Fatal("the worker did not stop after SIGTERM")
		}
		if n := len(ledgerOrder(t, e, op)); n != 0 {
			t.Fatalf("stop %d: the credit job ran (%d rows); the test needs it to wait behind the sleep job", i, n)
		}
	}
	e.startWorker(skWorkerOptions{})
	testkit.WaitFor(t, "the credit job settled", time.Minute, e.idle)
	var dead []skEntry
	e.ruby(&dead, "dead", nil)
	for _, d := range dead {
		t.Errorf("dead set holds %s (%v: %v): a job that never started, handed back by graceful stops, is not poison",
			d.JID, d.Item["error_class"], d.Item["error_message"])
	}
	if n := len(ledgerOrder(t, e, op)); n != 1 {
		t.Errorf("the credit job's effect: %d rows, want 1", n)
	}
}
