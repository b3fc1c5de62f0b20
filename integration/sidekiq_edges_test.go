package integration

import (
	"testing"
	"time"

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
