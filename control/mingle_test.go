package control

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// TestPythonWorkerExpiresRevokedFromHello: a Python Celery worker whose
// revoked ids expire after 20 s learns an id revoked on the node through
// mingle's hello, and forgets it once the id is 20 s old, counted from when
// it was revoked on the node: the node sends LimitedSet's monotonic times.
func TestPythonWorkerExpiresRevokedFromHello(t *testing.T) {
	const expires = 20 * time.Second
	n := startNode(t, false)
	id := "expiring-" + strings.TrimPrefix(testenv.Name("t"), "t_")
	n.celery(t, "control", "revoke", id, "-d", n.name)
	revokedAt := time.Now()

	pyNode := "py-" + strings.TrimPrefix(testenv.Name("t"), "t_") + "@vm"
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, n.py, "-m", "celery", "-A", "app", "worker", "-n", pyNode,
		"-Q", n.queue+"_py", "--pool=solo", "--loglevel=info")
	cmd.Dir, cmd.Env = "testdata", append(n.env(), "ONCELER_PY_REVOKE_EXPIRES=20")
	log := &testkit.Buffer{}
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = cmd.Process.Signal(os.Interrupt)
		_ = cmd.Wait()
	}()
	py := &node{name: pyNode, queue: n.queue, url: n.url, py: n.py}
	pyRevoked := func() ([]any, bool) {
		c := exec.Command(n.py, "hello.py", pyNode)
		c.Dir, c.Env = "testdata", py.env()
		b, err := c.Output()
		if err != nil {
			return nil, false
		}
		var r struct{ Revoked map[string]any }
		if json.Unmarshal(b, &r) != nil || r.Revoked == nil {
			return nil, false
		}
		ids := make([]any, 0, len(r.Revoked))
		for k := range r.Revoked {
			ids = append(ids, k)
		}
		return ids, true
	}
	learned := false
	for time.Since(revokedAt) < expires-time.Second && !learned {
		ids, ok := pyRevoked()
		learned = ok && slices.Contains(ids, any(id))
		if !learned {
			time.Sleep(200 * time.Millisecond)
		}
	}
	if !learned {
		t.Fatalf("the Python worker did not learn %s from the node's hello within %v\n%s", id, expires, log.String())
	}
	time.Sleep(time.Until(revokedAt.Add(expires + 1500*time.Millisecond)))
	ids, ok := pyRevoked()
	if !ok || slices.Contains(ids, any(id)) {
		t.Fatalf("%v after it was revoked, the Python worker (revoked ids expire after %v) still holds %s: %v (reply %v)\n%s",
			time.Since(revokedAt).Round(time.Second), expires, id, ids, ok, log.String())
	}
	if strings.Contains(log.String(), "Traceback") {
		t.Errorf("the Python worker logged an error:\n%s", log.String())
	}
	if !n.ctl.Revoked().Contains(id) {
		t.Errorf("the node forgot %s: its own expiry is 3 h", id)
	}
}

// TestHelloMergesByAge: ids in LimitedSet's form keep their age (one past
// the expiry is not taken, one younger expires when its time is up); plain
// numbers count from now; the reply gives [monotonic time, id] floats.
func TestHelloMergesByAge(t *testing.T) {
	c := newUnitController(t, Config{RevokedTTL: time.Minute})
	mono := monotonic()
	res, _ := c.dispatch(context.Background(), &celeryproto.ControlRequest{Method: "hello", Arguments: map[string]any{
		"from_node": "celery@py",
		"revoked":   map[string]any{"old": []any{mono - 120.5, "old"}, "young": []any{mono - 30.5, "young"}, "plain": 5.0},
	}})
	if c.Revoked().Contains("old") || !c.Revoked().Contains("young") || !c.Revoked().Contains("plain") {
		t.Fatalf("after hello: %v", c.Revoked().IDs())
	}
	rv, _ := res.(map[string]any)["revoked"].(map[string]any)
	young, _ := rv["young"].([]any)
	if len(rv) != 2 || len(young) != 2 || young[1] != "young" {
		t.Fatalf("hello reply revoked = %v", rv)
	}
	if at, _ := young[0].(float64); at < mono-31 || at > mono-30 {
		t.Errorf("young sent as revoked at %v, want about %v", at, mono-30.5)
	}
	now := time.Now()
	c.revoked.now = func() time.Time { return now.Add(31 * time.Second) }
	if c.Revoked().Contains("young") || !c.Revoked().Contains("plain") {
		t.Errorf("31 s later: %v", c.Revoked().IDs())
	}
}
