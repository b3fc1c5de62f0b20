package integration

import (
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/internal/testkit"
)

// skWorker is an onceler worker process of the Sidekiq or SQS harness,
// killed when the test ends.
type skWorker struct {
	*replay.Process
}

// workerProcs is the worker processes a harness (skEnv, sqsEnv) started.
type workerProcs struct {
	mu      sync.Mutex
	workers []*skWorker
	seq     int
}

// nextName is a unique node name for the next worker.
func (s *workerProcs) nextName(prefix string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.seq++
	return testkit.Name(fmt.Sprintf("%s%d", prefix, s.seq))
}

// start starts 'onceler worker' as name with env and waits until it logs
// that it started. A worker that exited before is returned when
// crashedEarly says it did so on purpose (its crash injection); otherwise
// the test fails. The worker is killed when the test ends, its log shown
// if the test failed.
func (s *workerProcs) start(t *testing.T, name string, env []string, crashedEarly func(*skWorker) bool) *skWorker {
	t.Helper()
	cmd := exec.Command(oncelerBin, "worker")
	cmd.Env = env
	p, err := replay.StartProcess(cmd, name, filepath.Join(t.TempDir(), name+".log"))
	if err != nil {
		t.Fatal(err)
	}
	w := &skWorker{p}
	s.mu.Lock()
	s.workers = append(s.workers, w)
	s.mu.Unlock()
	t.Cleanup(func() {
		w.Kill()
		if t.Failed() {
			t.Logf("log of worker %s (%s):\n%s", w.Name, w.State(), w.LogTail(6000))
		}
	})
	ok := testkit.Eventually(60*time.Second, func() bool {
		return w.Exited() || strings.Contains(w.Log(), `"worker started"`)
	})
	if crashedEarly != nil && w.Exited() && w.Crashed() && crashedEarly(w) {
		return w
	}
	if !ok || w.Exited() {
		t.Fatalf("worker %s not started (exited %v):\n%s", name, w.Exited(), w.LogTail(4000))
	}
	return w
}

// all is the workers started so far.
func (s *workerProcs) all() []*skWorker {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]*skWorker(nil), s.workers...)
}

// killAll kills every worker.
func (s *workerProcs) killAll() {
	for _, w := range s.all() {
		w.Kill()
	}
}

// stopAll stops every live worker with SIGTERM, failing t if one does not
// stop within 30 s.
func (s *workerProcs) stopAll(t *testing.T) {
	for _, w := range s.all() {
		if w.Exited() {
			continue
		}
		if !w.Terminate(30 * time.Second) {
			t.Errorf("worker %s did not stop within 30s after SIGTERM", w.Name)
			w.Kill()
		}
	}
}
