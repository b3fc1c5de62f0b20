package control_test

import (
	"strings"
	"testing"
)

// Hostile inputs to the run-time commands against the real tasks.Worker,
// driven by Python Celery (testdata/edges.py).

// TestTasksWorkerPoolGrowHuge: pool_grow by 2**63-1 (an int Python sends
// as is) must not leave the worker with fewer slots than before: it grows
// to the most slots there may be, or is refused.
func TestTasksWorkerPoolGrowHuge(t *testing.T) {
	n := startTasksNode(t, false)
	res := n.Script(t, "edges.py", "poolgrow")
	before, _ := res["slots_before"].(float64)
	after, _ := res["slots_after"].(float64)
	if before != 4 {
		t.Fatalf("slots before %v", res["slots_before"])
	}
	if grow, _ := res["grow"].(map[string]any); grow["ok"] != nil && after < before {
		t.Errorf("pool_grow(2**63-1) answered %v and left %v slots (was %v)", res["grow"], after, before)
	}
}

// TestTasksWorkerInspectNaNArgument: a task called with a NaN argument
// (Celery's JSON sends NaN) and held for its ETA must not make inspect
// scheduled fail for every task held: both tasks are listed.
func TestTasksWorkerInspectNaNArgument(t *testing.T) {
	n := startTasksNode(t, false)
	res := n.Script(t, "edges.py", "nanargs")
	ids, _ := res["ids"].([]any)
	l, ok := res["scheduled"].([]any)
	if !ok || len(l) != 2 {
		t.Fatalf("inspect scheduled with a task whose argument is NaN = %v, want both tasks %v", res["scheduled"], ids)
	}
	got := asJSON(l)
	for _, id := range ids {
		if !strings.Contains(got, id.(string)) {
			t.Errorf("inspect scheduled misses %v: %s", id, got)
		}
	}
}
