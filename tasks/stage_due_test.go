package tasks

import (
	"encoding/json"
	"testing"

	"github.com/onceler/onceler/internal/testenv"
)

// TestCountdownAndExpiresWithPython: 40 countdown tasks held at once do not
// block 10 immediate ones sent behind them (prefetch 4); countdown=3 is not
// ready before 3 s and is right after; an expires that passes while the task waits for its
// countdown makes AsyncResult.get() raise TaskRevokedError when it passes.
func TestCountdownAndExpiresWithPython(t *testing.T) {
	e := newEnv(t)
	rec := &callRecorder{}
	cfg := e.config()
	cfg.Concurrency, cfg.Prefetch = 2, 4
	e.start(workflowRegistry(t, rec), cfg)
	flood := e.workflows(testenv.Name("unused"), "eta_flood")["eta_flood"]
	var f struct {
		Quick        []int64 `json:"quick"`
		QuickSeconds float64 `json:"quick_seconds"`
		Held         []int64 `json:"held"`
		HeldSeconds  float64 `json:"held_seconds"`
	}
	if err := json.Unmarshal(flood.OK, &f); err != nil {
		t.Fatalf("eta_flood: %+v: %v", flood, err)
	}
	t.Logf("10 immediate tasks behind 40 held countdown tasks (prefetch 4): answered in %.3f s; all countdown results read after %.3f s",
		f.QuickSeconds, f.HeldSeconds)
	if len(f.Quick) != 10 || len(f.Held) != 40 || f.Quick[9] != 10 || f.Held[39] != 39 {
		t.Errorf("eta_flood results %+v", f)
	}
	if f.QuickSeconds > 4 || f.HeldSeconds < 5 {
		t.Errorf("immediate tasks took %.3f s behind held ones (want < 4 s: they would wait the 5 s countdown if held behind); countdown tasks took %.3f s (want >= 5 s)",
			f.QuickSeconds, f.HeldSeconds)
	}
	res := e.calls(
		wfCall{Name: "countdown", Task: "t.add", Args: []any{2, 3}, Options: map[string]any{"countdown": 3}, ReadyAt: 2.5},
		wfCall{Name: "expires", Task: "t.add", Args: []any{2, 3}, Options: map[string]any{"countdown": 4, "expires": 1}},
	)
	if r := res["countdown"]; string(r.Result) != "5" || r.ReadyEarly == nil || *r.ReadyEarly || r.Elapsed < 3 || r.Elapsed > 4.5 {
		t.Errorf("countdown=3: %+v", r)
	}
	// Answered when it expires, not when it would have been due.
	if r := res["expires"]; r.ExcType != "TaskRevokedError" || r.Message != "expired" || r.Elapsed < 1 || r.Elapsed > 3 {
		t.Errorf("expired before it ran: %+v", r)
	}
}
