package tasks

import (
	"strings"
	"testing"
	"time"
)

// TestLongKeyAnsweredAndQuarantined: a real Celery caller of an outside
// task whose operation key is 16 kB (beyond idempotency.MaxKeyBytes; the
// record's index could not keep it) gets TypeError within seconds; the
// message is quarantined as bad arguments, the task never runs, and the
// worker keeps serving.
func TestLongKeyAnsweredAndQuarantined(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := &effects{}
	e.start(testRegistry(t, fx), e.config())
	start := time.Now()
	res := e.python(2, "json",
		pyCall{Task: "t.pay", Kwargs: map[string]any{"order_id": strings.Repeat("k", 16<<10), "amount": 5}},
		pyCall{Task: "t.pay", Kwargs: map[string]any{"order_id": "fine-1", "amount": 5}, AfterPrevious: true},
	)
	if res[0].ExcType != "TypeError" || !strings.Contains(res[0].Message, "at most 1024 bytes") {
		t.Errorf("long key answered %+v", res[0])
	}
	if !strings.Contains(string(res[1].OK), "fine-1") {
		t.Errorf("worker stopped serving: %+v", res[1])
	}
	if took := time.Since(start); took > 20*time.Second {
		t.Errorf("answers took %s", took)
	}
	q := e.quarantined()
	if len(q) != 1 || q[0].Headers[HeaderReason] != ReasonBadArguments {
		t.Errorf("quarantined %d messages", len(q))
	}
	if got := fx.snapshot(); len(got) != 1 || got["fine-1"] != 1 {
		t.Errorf("effects %v", got)
	}
}
