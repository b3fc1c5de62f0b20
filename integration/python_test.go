package integration

import (
	"context"
	"encoding/json"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// TestPythonProducerDuplicates has real Python Celery (rpc backend) send the
// duplicates: one message id three times, the same operation again under a
// new id, and an outside operation twice. Two onceler workers answer every
// caller, and each operation has its effect once.
func TestPythonProducerDuplicates(t *testing.T) {
	t.Parallel()
	py := testenv.Python(t)
	e := demoEnv(t)
	e.StartWorker(replay.WorkerOptions{})
	e.StartWorker(replay.WorkerOptions{})
	credit, charge := opName("py-credit", 0), opName("py-charge", 0)
	idA, idC := testkit.NewID(), testkit.NewID()
	creditArgs := []any{"acct-" + credit, credit, 700}
	calls := []map[string]any{
		{"task": demo.TaskCredit, "args": creditArgs, "task_id": idA},
		{"task": demo.TaskCredit, "args": creditArgs, "task_id": idA},
		{"task": demo.TaskCredit, "args": creditArgs, "task_id": idA},
		{"task": demo.TaskCredit, "args": creditArgs}, // the client's retry: a new id
		{"task": demo.TaskCharge, "args": []any{charge}, "kwargs": map[string]any{"cents": 250}, "task_id": idC},
		{"task": demo.TaskCharge, "args": []any{charge}, "kwargs": map[string]any{"cents": 250}, "task_id": idC},
	}
	spec, _ := json.Marshal(map[string]any{"broker": e.AMQPURL, "queue": e.Queue, "timeout": 60, "calls": calls})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, py, filepath.Join("testdata", "producer.py"), string(spec)).Output()
	if err != nil {
		var stderr []byte
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = ee.Stderr
		}
		t.Fatalf("producer.py: %v\n%s", err, stderr)
	}
	var res struct {
		Results []struct {
			ID      string         `json:"id"`
			OK      map[string]any `json:"ok"`
			ExcType string         `json:"exc_type"`
			Message string         `json:"message"`
		}
	}
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("producer output %q: %v", out, err)
	}
	if len(res.Results) != 3 {
		t.Fatalf("%d results, want 3 (ids A, the retry, C): %s", len(res.Results), out)
	}
	for _, r := range res.Results {
		if r.ExcType != "" || r.OK == nil {
			t.Errorf("task %s: %s %s", r.ID, r.ExcType, r.Message)
		}
	}
	if a, b := res.Results[0].OK, res.Results[1].OK; a["entry_id"] != credit || b["entry_id"] != credit || a["balance"] != b["balance"] {
		t.Errorf("credit results %v and %v: want the same stored result for both callers", a, b)
	}
	time.Sleep(time.Second)
	e.StopAll()
	if n, err := demo.CountLedger(ctx, e.Pool, credit); err != nil || n != 1 {
		t.Errorf("ledger rows %d (err %v), want 1", n, err)
	}
	if n, err := demo.CountGatewayCalls(ctx, e.Pool, charge); err != nil || n != 1 {
		t.Errorf("gateway calls %d (err %v), want 1", n, err)
	}
	if d, err := e.QueueDepth(e.Queue); err != nil || d != 0 {
		t.Errorf("queue depth %d (err %v)", d, err)
	}
}
