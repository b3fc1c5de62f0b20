package replay

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/onceler/onceler/internal/testkit"
)

// WorkerOptions are the settings of one worker process.
type WorkerOptions struct {
	// CrashAt arms crash injection (ONCELER_CRASH_AT): after_claim,
	// after_effect or before_ack. CrashTask limits it to one task.
	CrashAt, CrashTask string
	// NoRecord runs the worker without the idempotency record
	// (ONCELER_NO_RECORD=true).
	NoRecord bool
	// Concurrency and Prefetch (ONCELER_CONCURRENCY, ONCELER_PREFETCH);
	// default 4 and 8.
	Concurrency, Prefetch int
	// BrokerURL and DatabaseURL replace the Env's for this worker (e.g. a
	// proxy in front of the service; DatabaseURL also replaces
	// Config.WorkerDatabaseURL); the node name is still added to the
	// database URL as application_name.
	BrokerURL, DatabaseURL string
	// Env holds extra environment variables for this worker.
	Env []string
	// NoWait returns without waiting for the worker to consume.
	NoWait bool
}

// Worker is a worker process started by StartWorker. It is killed when the
// test ends, whatever happens. Its Name is its node name
// (ONCELER_HOSTNAME), also its broker connection name and its PostgreSQL
// application_name.
type Worker struct {
	*Process

	e *Env
}

// WorkerSettings is the environment the test harnesses give every onceler
// worker besides its transport, database, schema, queues and lease: its
// node name, concurrency and prefetch, a 5 s grace, JSON logs, whether it
// runs without the record, and its crash injection (at crashAt, in
// crashTask; none when crashAt is empty).
func WorkerSettings(name string, concurrency, prefetch int, noRecord bool, crashAt, crashTask string) []string {
	env := []string{
		"ONCELER_HOSTNAME=" + name,
		"ONCELER_CONCURRENCY=" + strconv.Itoa(concurrency),
		"ONCELER_PREFETCH=" + strconv.Itoa(prefetch),
		"ONCELER_GRACE=5s",
		"ONCELER_LOG_FORMAT=json",
		"ONCELER_NO_RECORD=" + strconv.FormatBool(noRecord),
	}
	if crashAt != "" {
		env = append(env, "ONCELER_CRASH_AT="+crashAt, "ONCELER_CRASH_TASK="+crashTask)
	}
	return env
}

// StartWorker starts a worker process on the Env's queue and schema and
// waits until it consumes.
func (e *Env) StartWorker(o WorkerOptions) *Worker {
	e.t.Helper()
	if o.Concurrency <= 0 {
		o.Concurrency = 4
	}
	if o.Prefetch <= 0 {
		o.Prefetch = 2 * o.Concurrency
	}
	e.mu.Lock()
	e.seq++
	seq := e.seq
	e.mu.Unlock()
	name := testkit.Name(fmt.Sprintf("replay%d", seq))
	dir := e.t.TempDir()
	logPath := filepath.Join(dir, name+".log")
	env := []string{}
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "ONCELER_") {
			env = append(env, kv)
		}
	}
	broker, db := e.AMQPURL, e.DatabaseURL
	if e.cfg.WorkerDatabaseURL != "" {
		db = e.cfg.WorkerDatabaseURL
	}
	if e.cfg.WorkerBrokerURL != "" {
		broker = e.cfg.WorkerBrokerURL
	}
	if o.BrokerURL != "" {
		broker = o.BrokerURL
	}
	if o.DatabaseURL != "" {
		db = o.DatabaseURL
	}
	env = append(env,
		"ONCELER_BROKER_URL="+broker,
		"ONCELER_DATABASE_URL="+databaseURL(db, name),
		"ONCELER_SCHEMA="+e.Schema,
		"ONCELER_QUEUES="+e.Queue,
		"ONCELER_LEASE="+e.cfg.Lease.String(),
		"ONCELER_QUORUM="+strconv.FormatBool(e.cfg.Quorum),
	)
	env = append(env, WorkerSettings(name, o.Concurrency, o.Prefetch, o.NoRecord, o.CrashAt, o.CrashTask)...)
	if e.cfg.ResultBackend != "" {
		env = append(env, "ONCELER_RESULT_BACKEND="+e.cfg.ResultBackend)
	}
	env = append(env, e.cfg.Env...)
	env = append(env, o.Env...)
	cmd := exec.Command(e.cfg.Binary, e.cfg.Command...)
	cmd.Env = env
	p, err := StartProcess(cmd, name, logPath)
	if err != nil {
		e.t.Fatalf("start worker %s: %v", e.cfg.Binary, err)
	}
	w := &Worker{Process: p, e: e}
	e.mu.Lock()
	e.workers = append(e.workers, w)
	e.mu.Unlock()
	e.t.Cleanup(func() {
		w.Kill()
		if e.t.Failed() {
			e.t.Logf("log of worker %s (%s):\n%s", w.Name, w.State(), w.LogTail(6000))
		}
	})
	if !o.NoWait {
		e.waitConsumers(w)
	}
	return w
}

// waitConsumers waits until every live worker consumes the queue.
func (e *Env) waitConsumers(w *Worker) {
	e.t.Helper()
	ok := testkit.Eventually(90*time.Second, func() bool {
		if w != nil && w.Exited() {
			return true
		}
		n, err := e.Consumers()
		return err == nil && n >= e.Live()
	})
	if w != nil && w.Exited() {
		e.t.Fatalf("worker %s exited at start (%s):\n%s", w.Name, w.State(), w.LogTail(4000))
	}
	if !ok {
		e.t.Fatalf("workers not consuming after 90s (%d live)", e.Live())
	}
}

// Live returns how many of the Env's worker processes are running.
func (e *Env) Live() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	n := 0
	for _, w := range e.workers {
		if !w.Exited() {
			n++
		}
	}
	return n
}

// Workers returns the worker processes started so far.
func (e *Env) Workers() []*Worker {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]*Worker(nil), e.workers...)
}

// StopAll stops every live worker gracefully (SIGTERM), killing those that
// do not stop within 30 s.
func (e *Env) StopAll() {
	for _, w := range e.Workers() {
		w.Stop()
	}
}

// Stop asks the process to stop (SIGTERM), waits up to 30 s, then kills it
// and fails the test.
func (w *Worker) Stop() {
	if !w.Terminate(30 * time.Second) {
		w.e.t.Errorf("worker %s did not stop within 30s after SIGTERM; killed", w.Name)
		w.Kill()
	}
}

// Build compiles a Go main package (e.g. "github.com/onceler/onceler/cmd/onceler"
// or "./cmd/mytasks") into dir and returns the binary's path. Build once per
// test run, in TestMain, and hand the path to the suite.
func Build(ctx context.Context, dir, pkg string) (string, error) {
	out := filepath.Join(dir, filepath.Base(strings.TrimSuffix(pkg, "/")))
	cmd := exec.CommandContext(ctx, "go", "build", "-o", out, pkg)
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build %s: %w\n%s", pkg, err, b)
	}
	return out, nil
}
