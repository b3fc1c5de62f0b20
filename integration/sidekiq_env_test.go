package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceler/onceler/internal/testkit"
)

// The Sidekiq tests' world: a Redis database of their own (Sidekiq's
// layout is per database: its processes, stats and sets), a record schema,
// onceler workers started with --sidekiq, and Ruby Sidekiq 6 as the
// producer and the reader of what the workers write.

// skHeartbeat is the workers' --sidekiq-heartbeat: a killed worker's jobs
// are recovered 12 times this after its last beat.
const skHeartbeat = 500 * time.Millisecond

// skEnv is one test's Sidekiq world.
type skEnv struct {
	redisURL string
	rdb      *redis.Client
	queue    string

	queueEnv
}

func newSkEnv(t *testing.T) *skEnv {
	t.Helper()
	addr := testkit.RedisAddr(t)
	testkit.RequireRubySidekiq(t)
	dbURL := testkit.Postgres.URL(t)
	e := &skEnv{queue: "default", queueEnv: queueEnv{t: t, dbURL: dbURL, lease: 2 * time.Second}}
	e.lockRedis(addr)
	e.setup()
	return e
}

// newSkEnvAt is newSkEnv on database 0 of a Redis server of the test's own
// at addr (no lock taken).
func newSkEnvAt(t *testing.T, addr string) *skEnv {
	t.Helper()
	testkit.RequireRubySidekiq(t)
	dbURL := testkit.Postgres.URL(t)
	e := &skEnv{queue: "default", queueEnv: queueEnv{t: t, dbURL: dbURL, lease: 2 * time.Second}}
	e.rdb = redis.NewClient(&redis.Options{Addr: addr, DisableIdentity: true})
	e.redisURL = "redis://" + addr + "/0"
	t.Cleanup(func() { _ = e.rdb.Close() })
	e.setup()
	return e
}

// setup creates the test's record schema and the demo tables.
func (e *skEnv) setup() { e.setupRecord("sk") }

// lockRedis takes a free Redis database for the test, flushed when it
// ends.
func (e *skEnv) lockRedis(addr string) {
	t := e.t
	e.redisURL, e.rdb = testkit.RedisDB(t, addr)
}

// ruby runs the Sidekiq helper (sidekiq/testdata/sidekiq_helper.rb) and
// decodes its JSON output into out (may be nil).
func (e *skEnv) ruby(out any, cmd string, arg any) {
	e.t.Helper()
	e.rubyIn(out, cmd, arg, nil)
}

// rubyIn is ruby with stdin (may be nil) given to the helper.
func (e *skEnv) rubyIn(out any, cmd string, arg any, stdin []byte) {
	e.t.Helper()
	args := []string{filepath.Join("..", "sidekiq", "testdata", "sidekiq_helper.rb"), cmd}
	if arg != nil {
		b, err := json.Marshal(arg)
		if err != nil {
			e.t.Fatal(err)
		}
		args = append(args, string(b))
	}
	c := exec.Command(testkit.RubySidekiq, args...)
	c.Env = append(os.Environ(), "REDIS_URL="+e.redisURL)
	if stdin != nil {
		c.Stdin = bytes.NewReader(stdin)
	}
	var stderr strings.Builder
	c.Stderr = &stderr
	b, err := c.Output()
	if err != nil {
		e.t.Fatalf("ruby %s: %v\n%s", cmd, err, stderr.String())
	}
	if out != nil {
		if err := json.Unmarshal(b, out); err != nil {
			e.t.Fatalf("ruby %s output %q: %v", cmd, b, err)
		}
	}
}

// push pushes jobs with Sidekiq::Client.push, each a job hash; returns
// their jids.
func (e *skEnv) push(jobs ...map[string]any) []string {
	e.t.Helper()
	for _, j := range jobs {
		if _, ok := j["queue"]; !ok {
			j["queue"] = e.queue
		}
	}
	var jids []string
	e.ruby(&jids, "push_many", jobs)
	return jids
}

// idle reports whether no job is left in the queues, the working lists,
// the schedule or retry sets.
func (e *skEnv) idle() bool {
	ctx := context.Background()
	keys, err := e.rdb.Keys(ctx, "queue:*").Result()
	if err != nil {
		return false
	}
	work, err := e.rdb.Keys(ctx, "onceler:working:*").Result()
	if err != nil {
		return false
	}
	for _, k := range append(keys, work...) {
		if n, err := e.rdb.LLen(ctx, k).Result(); err != nil || n > 0 {
			return false
		}
	}
	for _, set := range []string{"schedule", "retry"} {
		if n, err := e.rdb.ZCard(ctx, set).Result(); err != nil || n > 0 {
			return false
		}
	}
	return true
}

// skWorkerOptions are the settings of one worker process.
type skWorkerOptions = queueWorkerOptions

// startWorker starts onceler worker --sidekiq and waits until it is in
// Sidekiq's process set.
func (e *skEnv) startWorker(o skWorkerOptions) *skWorker {
	e.t.Helper()
	name := e.nextName("sk")
	env := e.workerEnv(o, name, e.queue, []string{"ONCELER_"},
		"ONCELER_SIDEKIQ="+e.redisURL,
		"ONCELER_SIDEKIQ_HEARTBEAT="+skHeartbeat.String())
	var crashedEarly func(*skWorker) bool
	if o.MayCrash {
		crashedEarly = func(w *skWorker) bool { return strings.Contains(w.Log(), `"consuming Sidekiq jobs"`) }
	}
	return e.start(e.t, name, env, crashedEarly)
}

// identity is the worker's Sidekiq identity, from its log.
func (w *skWorker) identity(t *testing.T) string {
	t.Helper()
	for _, line := range strings.Split(w.Log(), "\n") {
		if !strings.Contains(line, `"consuming Sidekiq jobs"`) {
			continue
		}
		var m struct {
			Identity string `json:"identity"`
		}
		if err := json.Unmarshal([]byte(line), &m); err == nil && m.Identity != "" {
			return m.Identity
		}
	}
	t.Fatalf("worker %s logged no Sidekiq identity", w.Name)
	return ""
}
