package integration

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/internal/testkit"
	"github.com/onceler/onceler/tasks"
)

// faultTests reports whether the tests that disturb shared services
// (broker and database restarts) may run: only in CI's serial fault step.
func faultTests(t *testing.T) {
	t.Helper()
	if os.Getenv("ONCELER_FAULT_TESTS") != "1" {
		t.Skip("disturbs the shared broker or database: set ONCELER_FAULT_TESTS=1 (CI runs it in a serial step)")
	}
}

// operation is one operation of a workload and the calls made for it.
type operation struct {
	task, op string
	msgs     []*celeryproto.Message // one per caller (task id)
}

// workload sends operations of the demo tasks (and the replayworker's
// replay.notify) and checks each against its task's guarantee.
type workload struct {
	e    *replay.Env
	salt string // in every operation name (op), so that no other run repeats them
	ops  []*operation
	by   map[string]*operation
	// outsideDown accepts, for outside tasks, a failure answered to the
	// caller when the simulated outside system itself was down (it lives in
	// the database being restarted): the record says failed, and there is
	// no effect, or one when the outside system committed it but its answer
	// was lost with the connection (the task saw an error: outcome unknown).
	outsideDown bool
	// ctl runs rabbitmqctl against the workload's broker, nil where there
	// is none to run (a broker elsewhere, or not root): see queueSettled.
	ctl func(args ...string) (string, error)
}

func newWorkload(e *replay.Env) *workload {
	return &workload{e: e, salt: testkit.NewID()[:8], by: make(map[string]*operation), ctl: localCtl(e.AMQPURL)}
}

// localCtl returns rabbitmqctl for the shared local broker when the URL is
// that broker's and rabbitmqctl can reach it here, and nil otherwise.
func localCtl(amqpURL string) func(args ...string) (string, error) {
	u, err := url.Parse(amqpURL)
	if err != nil || os.Geteuid() != 0 {
		return nil
	}
	if h := u.Hostname(); (h != "127.0.0.1" && h != "localhost") || (u.Port() != "" && u.Port() != "5672") {
		return nil
	}
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		return nil
	}
	return sharedCtl
}

// sharedCtl runs rabbitmqctl against the shared local broker.
func sharedCtl(args ...string) (string, error) { return runCtl([]string{"rabbitmqctl"}, args...) }

// stopWorkers stops the workers once the queue is empty (a minute at
// most). Deliveries whose acknowledgement a fault cut come back to the
// queue after their callers were answered, and the workers answer them from
// the record once their consumers are back: the queue check of check then
// sees a delivery nobody takes, not a reconnect in progress.
func (w *workload) stopWorkers() {
	testkit.Eventually(time.Minute, w.queueSettled)
	w.e.StopAll()
}

// queueSettled reports whether the queue holds no message: none ready and, where
// rabbitmqctl can tell (ctl), none delivered and still unacknowledged. A
// worker that stops drains what it was handed and puts back what reaches it
// after its consumers were cancelled; a redelivery in flight to a worker at
// that moment would be put back and left in the queue, so the stop waits
// for it to be settled too.
func (w *workload) queueSettled() bool {
	n, err := w.e.QueueDepth(w.e.Queue)
	if err != nil || n != 0 {
		return false
	}
	if w.ctl == nil {
		return true
	}
	out, err := w.ctl("-q", "list_queues", "name", "messages")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) == 2 && f[0] == w.e.Queue {
			return f[1] == "0"
		}
	}
	return false
}

// op returns the name of the workload's operation i of a kind (prefix):
// the same for the same arguments, and used by no other workload, of this
// run or another (the demo tables are shared by every run, and -count
// repeats a test in one process).
func (w *workload) op(prefix string, i int) string {
	return opName(prefix+"-"+w.salt, i)
}

// args returns the Celery arguments of an operation of task.
func args(task, op string) []any {
	switch task {
	case demo.TaskCredit:
		return []any{"acct-" + op, op, 100}
	case demo.TaskCharge:
		return []any{op, 990}
	case demo.TaskEmail:
		return []any{op, "someone@example.com", "hello"}
	case demo.TaskSleep:
		return []any{op, 0.5}
	case demo.TaskAdd:
		return []any{2, 3}
	default: // replay.notify, replay.audit
		return []any{op}
	}
}

// send publishes a new call (a new task id) of operation op of task.
func (w *workload) send(task, op string) *celeryproto.Message {
	return w.sendArgs(task, op, args(task, op))
}

// sendArgs is send with the Celery arguments a.
func (w *workload) sendArgs(task, op string, a []any) *celeryproto.Message {
	o := w.by[op]
	if o == nil {
		o = &operation{task: task, op: op}
		w.by[op] = o
		w.ops = append(w.ops, o)
	}
	m := w.e.Message(task, testkit.NewID(), a, nil)
	o.msgs = append(o.msgs, m)
	w.e.Publish(m)
	return m
}

// ids returns every task id sent.
func (w *workload) ids() []string {
	var ids []string
	for _, o := range w.ops {
		for _, m := range o.msgs {
			ids = append(ids, m.ID)
		}
	}
	return ids
}

// answered returns how many task ids have a reply.
func (w *workload) answered() int {
	n := 0
	for _, id := range w.ids() {
		if len(final(w.e.Replies(id))) > 0 {
			n++
		}
	}
	return n
}

// reask re-sends, with the same task id, every call without a reply (as a
// client does after a timeout when its result was lost with a broker
// restart), and returns how many.
func (w *workload) reask() int {
	n := 0
	for _, o := range w.ops {
		for _, m := range o.msgs {
			if len(final(w.e.Replies(m.ID))) == 0 && !w.held(o) {
				w.e.Publish(m)
				n++
			}
		}
	}
	return n
}

func (w *workload) held(o *operation) bool {
	rec, err := w.e.Store.Get(context.Background(), o.task, o.op)
	return err == nil && rec.Status == idempotency.StatusHeld
}

// final keeps the replies that end a call. RETRY is not one: as Celery's
// AsyncResult.get() does, a caller waits on past it for the outcome.
func final(reps []replay.Reply) []replay.Reply {
	out := reps[:0:0]
	for _, r := range reps {
		if r.Status != "RETRY" {
			out = append(out, r)
		}
	}
	return out
}

// wait waits until every call not held is answered.
func (w *workload) wait(timeout time.Duration) bool {
	return testkit.Eventually(timeout, func() bool {
		for _, o := range w.ops {
			for _, m := range o.msgs {
				if len(final(w.e.Replies(m.ID))) == 0 && !w.held(o) {
					return false
				}
			}
		}
		return true
	})
}

func effects(ctx context.Context, pool *pgxpool.Pool, task, op string) (int, error) {
	switch task {
	case demo.TaskCredit:
		return demo.CountLedger(ctx, pool, op)
	case demo.TaskCharge:
		return demo.CountGatewayCharges(ctx, pool, op)
	case demo.TaskEmail:
		return demo.CountEmailSends(ctx, pool, op)
	case demo.TaskSleep:
		return demo.CountSleeps(ctx, pool, op)
	default:
		return countOwn(task)(ctx, pool, op)
	}
}

// tally is what a workload check found.
type tally struct {
	ops, calls, answered, lost, duplicates, held, retried, outsideFailed int
	// outsideUnknown counts the outsideFailed operations whose outside
	// system did commit the effect though the task saw an error (an email
	// sent again by a later call of the failed operation counts here).
	outsideUnknown int
	// effects counts the effects found (rows of the operations' effect
	// tables), for the closing tables.
	effects int
}

func (tl tally) String() string {
	return fmt.Sprintf("operations %d, calls %d, answered %d, lost %d, unexpected duplicates %d, held %d, run twice (policy retry) %d, failed by the outside system %d (of which its commit answer lost: %d)",
		tl.ops, tl.calls, tl.answered, tl.lost, tl.duplicates, tl.held, tl.retried, tl.outsideFailed, tl.outsideUnknown)
}

func (tl *tally) add(o tally) {
	tl.ops += o.ops
	tl.calls += o.calls
	tl.answered += o.answered
	tl.lost += o.lost
	tl.duplicates += o.duplicates
	tl.held += o.held
	tl.retried += o.retried
	tl.outsideFailed += o.outsideFailed
	tl.outsideUnknown += o.outsideUnknown
	tl.effects += o.effects
}

// outsideFailure reports whether every caller of o was told that the
// outside system failed, and the record says failed, with at most one
// effect (the outside system's commit whose answer was lost).
func (w *workload) outsideFailure(o *operation, rec idempotency.Record, n int) bool {
	if w.outsideDown && o.task == demo.TaskEmail && n == 2 && rec.Status == idempotency.StatusCompleted {
		// The mail service committed a send but its answer was lost with
		// the connection: the task failed (a caller was told so) and the
		// record with it, and a later call of the failed operation sent
		// again. The mail service has no reference to look a send up by.
		for _, m := range o.msgs {
			for _, r := range w.e.Replies(m.ID) {
				if outsideFailed(r) {
					return true
				}
			}
		}
		return false
	}
	if !w.outsideDown || o.task == demo.TaskCredit || o.task == demo.TaskSleep || rec.Status != idempotency.StatusFailed || n > 1 {
		return false
	}
	for _, m := range o.msgs {
		for _, r := range w.e.Replies(m.ID) {
			if !outsideFailed(r) {
				return false
			}
		}
	}
	return true
}

// outsideFailed reports whether r tells the caller that a simulated
// outside system failed the call.
func outsideFailed(r replay.Reply) bool {
	msg := string(r.Result)
	return r.Status == "FAILURE" && (strings.Contains(msg, "payment gateway") || strings.Contains(msg, "mail service") ||
		strings.Contains(msg, "outside service"))
}

// check asserts each operation's guarantee: same-database and charges
// (lookup) exactly once; email (hold) at most once, held or completed;
// replay.notify (retry) once or twice. Every call not held is answered,
// the queue and quarantine are empty, no claim is stale.
func (w *workload) check(t *testing.T) tally {
	t.Helper()
	byTask := w.checkByTask(t)
	var tl tally
	for _, x := range byTask {
		tl.add(*x)
	}
	return tl
}

// checkByTask is check, with the tally of each task.
func (w *workload) checkByTask(t *testing.T) map[string]*tally {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	byTask := make(map[string]*tally)
	var problems []string
	for _, o := range w.ops {
		row := o.task
		if len(o.op) > idempotency.MaxKeyBytes {
			row = "16 kB key (refused)"
		}
		tl := byTask[row]
		if tl == nil {
			tl = &tally{}
			byTask[row] = tl
		}
		tl.ops++
		if refused(o) {
			// Hostile input: the task fails by its own work every time, or
			// its key is too long for the record. No effect, no completed
			// record, every caller a FAILURE (a long key quarantined).
			w.checkRefused(ctx, t, o, tl, &problems)
			continue
		}
		if o.task == demo.TaskAdd {
			// Pure: no record, no effect; every caller answered.
			for _, m := range o.msgs {
				tl.calls++
				if len(w.e.Replies(m.ID)) > 0 {
					tl.answered++
				} else {
					tl.lost++
					problems = append(problems, fmt.Sprintf("%s %s: caller %s got no result", o.task, o.op, m.ID))
				}
			}
			continue
		}
		n, err := effects(ctx, w.e.Pool, o.task, o.op)
		if err != nil {
			t.Fatalf("effects of %s: %v", o.op, err)
		}
		tl.effects += n
		rec, err := w.e.Store.Get(ctx, o.task, o.op)
		if err != nil {
			tl.lost++
			tl.calls += len(o.msgs)
			for _, m := range o.msgs {
				problems = append(problems, fmt.Sprintf("%s %s: no record (%v); its caller got %v", o.task, o.op, err, w.e.Replies(m.ID)))
			}
			continue
		}
		if w.outsideFailure(o, rec, n) {
			tl.outsideFailed++
			if n >= 1 {
				tl.outsideUnknown++
			}
			tl.calls += len(o.msgs)
			tl.answered += len(o.msgs)
			continue
		}
		held := rec.Status == idempotency.StatusHeld
		switch {
		case n == 0 && !held:
			tl.lost++
			problems = append(problems, fmt.Sprintf("%s %s: no effect (record %s)", o.task, o.op, rec.Status))
		case (o.task == "replay.notify" || o.task == "replay.nul") && n == 2:
			tl.retried++
		case n > 1:
			tl.duplicates++
			problems = append(problems, fmt.Sprintf("%s %s: %d effects", o.task, o.op, n))
		}
		if held {
			tl.held++
			if o.task != demo.TaskEmail {
				problems = append(problems, fmt.Sprintf("%s %s: held", o.task, o.op))
			}
		} else if rec.Status != idempotency.StatusCompleted {
			problems = append(problems, fmt.Sprintf("%s %s: record %s, want completed", o.task, o.op, rec.Status))
		}
		for _, m := range o.msgs {
			tl.calls++
			reps := final(w.e.Replies(m.ID))
			if len(reps) > 0 {
				tl.answered++
			} else if !held {
				problems = append(problems, fmt.Sprintf("%s %s: caller %s got no result", o.task, o.op, m.ID))
			}
			for _, r := range reps {
				if held && r.Status == "FAILURE" && r.ExcType == "OperationHeld" {
					continue
				}
				if r.Status != "SUCCESS" && !(w.outsideDown && outsideFailed(r)) {
					problems = append(problems, fmt.Sprintf("%s %s: caller %s got %s %s", o.task, o.op, m.ID, r.Status, r.Result))
				}
			}
		}
	}
	sort.Strings(problems)
	if len(problems) > 0 {
		if len(problems) > 30 {
			problems = append(problems[:30], fmt.Sprintf("... and %d more", len(problems)-30))
		}
		t.Errorf("%d problems:\n%s", len(problems), strings.Join(problems, "\n"))
	}
	if n, err := w.e.QueueDepth(w.e.Queue); err != nil || n != 0 {
		t.Errorf("queue: %d messages left (err %v), want 0", n, err)
	}
	q, err := w.e.TakeQuarantined()
	if err != nil {
		t.Errorf("quarantine: %v", err)
	}
	// Only long keys, as bad arguments, each at least once (twice when a
	// worker died between the move and its ack).
	want := map[string]bool{}
	for _, o := range w.ops {
		if len(o.op) > idempotency.MaxKeyBytes {
			for _, m := range o.msgs {
				want[m.ID] = true
			}
		}
	}
	seen := map[string]bool{}
	for _, m := range q {
		if !want[m.TaskID] || m.Reason != tasks.ReasonBadArguments {
			t.Errorf("quarantined %s (%s: %.80s), want only long keys", m.TaskID, m.Reason, m.Detail)
		}
		seen[m.TaskID] = true
	}
	if len(seen) != len(want) {
		t.Errorf("quarantine: %d of %d long-key calls", len(seen), len(want))
	}
	if n, err := w.e.StaleClaims(ctx); err != nil || n != 0 {
		t.Errorf("stale claims: %d (err %v), want 0", n, err)
	}
	return byTask
}

// refused reports whether o is hostile input the worker must refuse:
// tasks that fail by their own transaction, or a key too long to keep.
func refused(o *operation) bool {
	return o.task == "replay.swallow" || o.task == "replay.deferred" || len(o.op) > idempotency.MaxKeyBytes
}

// checkRefused checks a refused operation: no effect, no completed record,
// every caller answered FAILURE.
func (w *workload) checkRefused(ctx context.Context, t *testing.T, o *operation, tl *tally, problems *[]string) {
	t.Helper()
	n, err := effects(ctx, w.e.Pool, o.task, o.op)
	if err != nil {
		t.Fatalf("effects of %.40s: %v", o.op, err)
	}
	name := o.op
	if len(name) > 40 {
		name = name[:20] + "..." + name[len(name)-20:]
	}
	if n != 0 {
		tl.duplicates++
		*problems = append(*problems, fmt.Sprintf("%s %s: %d effects of refused input", o.task, name, n))
	}
	if rec, err := w.e.Store.Get(ctx, o.task, o.op); err == nil && rec.Status != idempotency.StatusFailed {
		*problems = append(*problems, fmt.Sprintf("%s %s: record %s, want none or failed", o.task, name, rec.Status))
	}
	for _, m := range o.msgs {
		tl.calls++
		reps := final(w.e.Replies(m.ID))
		if len(reps) == 0 {
			tl.lost++
			*problems = append(*problems, fmt.Sprintf("%s %s: caller %s got no result", o.task, name, m.ID))
			continue
		}
		tl.answered++
		for _, r := range reps {
			if r.Status != "FAILURE" {
				*problems = append(*problems, fmt.Sprintf("%s %s: caller %s got %s", o.task, name, m.ID, r.Status))
			}
		}
	}
}

// migrate creates the demo tables before a test counts effects in them.
func migrate(t *testing.T, e *replay.Env) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := demo.Migrate(ctx, e.Pool); err != nil {
		t.Fatal(err)
	}
}

// opName returns a name for operation i that no other test run uses (the
// demo tables are shared by every run).
func opName(prefix string, i int) string {
	return fmt.Sprintf("%s-%s-%d", prefix, runID, i)
}
