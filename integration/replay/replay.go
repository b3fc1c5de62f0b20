package replay

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testkit"
	"github.com/onceler/onceler/internal/workerhooks"
	"github.com/onceler/onceler/tasks"
)

// Target is a task to replay, and the worker binary that serves it.
type Target struct {
	// Binary is the worker binary (see Build); Command its arguments, e.g.
	// {"worker", "--migrate"} for onceler; Env extra environment variables.
	Binary  string
	Command []string
	Env     []string

	// Task is the Celery task name.
	Task string
	// Mode and Policy are the task's, as registered: they decide the effect
	// counts each scenario asserts. Policy matters for ModeOutside only.
	Mode   tasks.Mode
	Policy tasks.Policy
	// Arguments builds the Celery args and kwargs of operation op. op is
	// unique per operation (for the run and the scenario); two calls with
	// the same op must give the same arguments, and the same operation key.
	Arguments func(op string) (args []any, kwargs map[string]any)
	// Key is the operation key the task derives from Arguments(op).
	// Default: op itself.
	Key func(op string) string
	// Effects counts the effects of operation op in the system it touches
	// (rows written, calls made); pool is on the test database. Nil for a
	// task without effects: then only the callers' results, the queue and
	// the record are checked.
	Effects func(ctx context.Context, pool *pgxpool.Pool, op string) (int, error)
	// Exception is the Python exception type every caller gets, for a task
	// that always fails (e.g. "ValueError"). Default: every caller gets
	// SUCCESS, unless the policy says otherwise.
	Exception string
	// Setup runs once before the scenarios, e.g. to create the tables that
	// Effects reads.
	Setup func(ctx context.Context, pool *pgxpool.Pool) error

	// NoRecord runs the workers with the record off (ONCELER_NO_RECORD):
	// every scenario must then show the duplicate it exists to prevent, and
	// the test fails if one does not.
	NoRecord bool
	// Lease is the workers' claim lease. Default DefaultLease.
	Lease time.Duration
	// Operations is the number of distinct operations of ScenarioMany.
	// Default 60.
	Operations int
	// ResultBackend is the workers' result backend, a redis:// URL
	// (Config.ResultBackend): every caller's result is then read from
	// Redis, one per task id. Default: rpc://.
	ResultBackend string
	// Scenarios limits the run to these scenarios. Default: all.
	Scenarios []Scenario
	// WorkerDatabaseURL and Prepare are Config's: the workers' own database
	// URL (e.g. a role with only a worker's privileges; the suite migrates
	// and inspects with its own), and what runs in each scenario's Env once
	// its record schema is migrated (e.g. the GRANTs of that role on
	// e.Schema).
	WorkerDatabaseURL string
	Prepare           func(ctx context.Context, e *Env) error
	// AMQPURL is the broker the suite itself uses (Config.AMQPURL);
	// WorkerBrokerURL the one its workers get (Config.WorkerBrokerURL),
	// e.g. the same vhost as a user with only the permissions a worker
	// needs.
	AMQPURL, WorkerBrokerURL string
}

// Scenario names one replay scenario; each runs as a subtest of that name.
type Scenario string

// The scenarios, in the order Run runs them.
const (
	// ScenarioRepeated delivers the same message three times in a row.
	ScenarioRepeated Scenario = "repeated"
	// ScenarioConcurrent delivers each operation to two workers at once.
	ScenarioConcurrent Scenario = "concurrent"
	// ScenarioCrashAfterClaim kills the worker after the claim; the
	// producer re-sends the operation; another worker finishes it after the
	// lease.
	ScenarioCrashAfterClaim Scenario = "crash_after_claim"
	// ScenarioCrashAfterEffect kills the worker after the effect, before
	// completion; the producer re-sends the operation.
	ScenarioCrashAfterEffect Scenario = "crash_after_effect"
	// ScenarioCrashBeforeAck kills the worker after completion, before the
	// ack; the producer re-sends the operation.
	ScenarioCrashBeforeAck Scenario = "crash_before_ack"
	// ScenarioMany sends many distinct operations over two workers, a fifth
	// of them re-sent: no real work may be skipped.
	ScenarioMany Scenario = "many"
)

// Scenarios returns every scenario, in order.
func Scenarios() []Scenario {
	return []Scenario{ScenarioRepeated, ScenarioConcurrent, ScenarioCrashAfterClaim,
		ScenarioCrashAfterEffect, ScenarioCrashBeforeAck, ScenarioMany}
}

// Expectation is what a scenario guarantees for one operation.
type Expectation struct {
	// Effects is the exact effect count with the record.
	Effects int
	// Status is the record's final status.
	Status idempotency.Status
	// Answered says whether every caller gets a result (the worker answers
	// even an operation held for a person: FAILURE OperationHeld).
	Answered bool
	// ExcType is the exception every caller gets ("" means SUCCESS).
	ExcType string
	// Takeover says a stale claim must have been taken over.
	Takeover bool
}

// Expect returns what a scenario guarantees for a task of this mode and
// policy, with the record on.
func Expect(s Scenario, mode tasks.Mode, policy tasks.Policy) Expectation {
	ok := Expectation{Effects: 1, Status: idempotency.StatusCompleted, Answered: true}
	if mode != tasks.ModeOutside || (s != ScenarioCrashAfterClaim && s != ScenarioCrashAfterEffect) {
		return ok
	}
	// The worker died holding the claim: after the lease the policy decides.
	effect := 0 // the crash came before the effect
	if s == ScenarioCrashAfterEffect {
		effect = 1
	}
	switch policy {
	case tasks.PolicyLookup:
		// Not found: taken over and run once; found: completed from the
		// lookup. Exactly one either way.
		return Expectation{Effects: 1, Status: idempotency.StatusCompleted, Answered: true, Takeover: effect == 0}
	case tasks.PolicyHold:
		return Expectation{Effects: effect, Status: idempotency.StatusHeld, Answered: true, ExcType: "OperationHeld"}
	case tasks.PolicySkip:
		return Expectation{Effects: effect, Status: idempotency.StatusSkipped, Answered: true, ExcType: "OperationSkipped"}
	default: // retry: run again, so at most two
		return Expectation{Effects: effect + 1, Status: idempotency.StatusCompleted, Answered: true, Takeover: true}
	}
}

// Run runs every scenario (or t.Scenarios) against the target, each as a
// subtest with its own queue, record schema and worker processes.
func Run(t *testing.T, target Target) {
	t.Helper()
	if target.Binary == "" || target.Task == "" || target.Arguments == nil {
		t.Fatal("replay: Target needs Binary, Task and Arguments")
	}
	if target.Key == nil {
		target.Key = func(op string) string { return op }
	}
	if target.Operations <= 0 {
		target.Operations = 60
	}
	scenarios := target.Scenarios
	if len(scenarios) == 0 {
		scenarios = Scenarios()
	}
	run := strings.ReplaceAll(testkit.NewID()[:8], "-", "")
	setup := false
	for _, s := range scenarios {
		t.Run(string(s), func(t *testing.T) {
			r := &runner{t: t, tg: target, s: s, prefix: fmt.Sprintf("%s-%s", run, s), start: time.Now()}
			r.e = NewEnv(t, Config{Binary: target.Binary, Command: target.Command, Env: target.Env, Lease: target.Lease,
				ResultBackend: target.ResultBackend, WorkerDatabaseURL: target.WorkerDatabaseURL, Prepare: target.Prepare,
				AMQPURL: target.AMQPURL, WorkerBrokerURL: target.WorkerBrokerURL})
			if !setup && target.Setup != nil {
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				if err := target.Setup(ctx, r.e.Pool); err != nil {
					t.Fatalf("setup: %v", err)
				}
				setup = true
			}
			r.run()
		})
	}
}

// runner runs one scenario.
type runner struct {
	t      *testing.T
	tg     Target
	s      Scenario
	e      *Env
	prefix string
	start  time.Time
	ops    []string            // the operations
	calls  map[string][]string // task ids per operation (one per caller)
	sends  int                 // deliveries per task id in ScenarioRepeated
}

func (r *runner) op(i int) string { return fmt.Sprintf("%s-%d", r.prefix, i) }

// send publishes operation op with a new task id (a new caller).
func (r *runner) send(op string) string {
	args, kwargs := r.tg.Arguments(op)
	id := r.e.Send(r.tg.Task, args, kwargs)
	r.calls[op] = append(r.calls[op], id)
	return id
}

func (r *runner) worker(o WorkerOptions) *Worker {
	o.NoRecord = r.tg.NoRecord
	return r.e.StartWorker(o)
}

func (r *runner) run() {
	r.calls = make(map[string][]string)
	r.sends = 1
	switch r.s {
	case ScenarioRepeated:
		r.repeated()
	case ScenarioConcurrent:
		r.concurrent()
	case ScenarioCrashAfterClaim:
		r.crash(workerhooks.AfterClaim)
	case ScenarioCrashAfterEffect:
		r.crash(workerhooks.AfterEffect)
	case ScenarioCrashBeforeAck:
		r.crash(workerhooks.BeforeAck)
	case ScenarioMany:
		r.many()
	default:
		r.t.Fatalf("unknown scenario %q", r.s)
	}
	r.check()
}

// repeated: three operations, each message delivered three times in a row
// (same task id, as a broker redelivery or a producer retry would).
func (r *runner) repeated() {
	r.worker(WorkerOptions{})
	r.sends = 3
	for i := range 3 {
		op := r.op(i)
		r.ops = append(r.ops, op)
		args, kwargs := r.tg.Arguments(op)
		m := r.e.Message(r.tg.Task, testkit.NewID(), args, kwargs)
		r.calls[op] = []string{m.ID}
		for range 3 {
			r.e.Publish(m)
		}
	}
}

// concurrent: two workers; each operation sent twice back to back, so the
// broker hands the copies to both workers at once.
func (r *runner) concurrent() {
	r.worker(WorkerOptions{})
	r.worker(WorkerOptions{})
	for i := range 5 {
		op := r.op(i)
		r.ops = append(r.ops, op)
		r.send(op)
		r.send(op)
	}
}

// crash: a worker armed to die at the point takes the operation; once it is
// dead, a second worker starts and the producer re-sends the operation (a
// client whose call timed out).
func (r *runner) crash(at string) {
	w1 := r.worker(WorkerOptions{CrashAt: at, CrashTask: r.tg.Task, Concurrency: 1, Prefetch: 1})
	op := r.op(0)
	r.ops = []string{op}
	first := r.send(op)
	// Without the record the pure path has no claim and no completion: the
	// worker may not reach the crash point. Either it dies, or it answers.
	noClaim := r.tg.NoRecord || r.tg.Mode == tasks.ModePure
	ok := testkit.Eventually(60*time.Second, func() bool {
		return w1.Exited() || (noClaim && len(r.e.Replies(first)) > 0)
	})
	if !ok {
		r.t.Fatalf("worker armed with %s neither crashed nor answered within 60s", at)
	}
	if !noClaim && !w1.Crashed() {
		r.t.Fatalf("worker armed with %s ended but not by its crash injection: %s", at, w1.State())
	}
	w1.Kill()
	r.worker(WorkerOptions{})
	r.send(op)
}

// many: distinct operations over two workers, every fifth re-sent.
func (r *runner) many() {
	r.worker(WorkerOptions{})
	r.worker(WorkerOptions{})
	for i := range r.tg.Operations {
		op := r.op(i)
		r.ops = append(r.ops, op)
		r.send(op)
		if i%5 == 4 {
			r.send(r.op(i - 2))
		}
	}
}

func (r *runner) expect() Expectation {
	if r.tg.Effects == nil && r.tg.Mode == tasks.ModePure {
		return Expectation{Answered: true, ExcType: r.tg.Exception}
	}
	return Expect(r.s, r.tg.Mode, r.tg.Policy)
}
