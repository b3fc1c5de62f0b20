package cmd

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// exampleDir is docs/example: a Go module of its own, the project users copy.
const exampleDir = "../docs/example"

// builtBinary is a program the tests build once per run.
type builtBinary struct {
	once sync.Once
	path string
	err  error
}

// get builds the package pkg in directory dir (with -race when the tests
// have it) as buildDir/name the first time, and returns its path.
func (b *builtBinary) get(t *testing.T, name, dir, pkg string) string {
	t.Helper()
	b.once.Do(func() {
		b.path = filepath.Join(buildDir, name)
		args := []string{"build", "-o", b.path}
		if raceEnabled {
			args = append(args, "-race")
		}
		c := exec.Command("go", append(args, pkg)...)
		c.Dir = dir
		if out, err := c.CombinedOutput(); err != nil {
			b.err = fmt.Errorf("go build %s in %s: %v\n%s", pkg, dir, err, out)
		}
	})
	if b.err != nil {
		t.Fatal(b.err)
	}
	return b.path
}

var example builtBinary

// exampleBinary builds docs/example as its users do, with go build in its
// own module directory, once per run.
func exampleBinary(t *testing.T) string { return example.get(t, "refunds", exampleDir, ".") }

// newExampleStack is a stack whose database URL sets search_path to the
// test's schema, so that the example's own table (refunds, unqualified, as
// users write it) lands there beside the record.
func newExampleStack(t *testing.T) *stack {
	t.Helper()
	s := newStack(t)
	u := s.env["ONCELER_DATABASE_URL"]
	switch {
	case !strings.Contains(u, "://"):
		u += " search_path=" + s.schema
	case strings.Contains(u, "?"):
		u += "&search_path=" + s.schema
	default:
		u += "?search_path=" + s.schema
	}
	s.env["ONCELER_DATABASE_URL"] = u
	return s
}

// startExampleWorker starts "refunds worker" and waits until it consumes.
func startExampleWorker(t *testing.T, bin string, env map[string]string) *proc {
	t.Helper()
	w := start(t, "refunds worker", env, bin, "worker")
	w.waitLog("consuming", 60*time.Second)
	return w
}

// callRefund runs docs/example/call.py and returns what it printed.
func (s *stack) callRefund(t *testing.T, orderID string, cents int) string {
	t.Helper()
	p := start(t, "call.py", s.env, testenv.Python(t), filepath.Join(exampleDir, "call.py"), orderID, fmt.Sprint(cents), "--queue", s.queue)
	if err := p.wait(2 * time.Minute); err != nil {
		t.Fatalf("call.py %s %d: %v\n%s", orderID, cents, err, p.stderr.String())
	}
	return p.stdout.String()
}

// nodeOf is the default node name (onceler-%p@%h) of a started worker.
func nodeOf(t *testing.T, w *proc) string {
	t.Helper()
	host, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("onceler-%d@%s", w.cmd.Process.Pid, host)
}

// celery runs Python Celery's command line against the stack's broker.
func (s *stack) celery(t *testing.T, args ...string) string {
	t.Helper()
	p := start(t, "celery", s.env, testenv.Python(t), append([]string{"-m", "celery", "-b", s.env["ONCELER_BROKER_URL"]}, args...)...)
	if err := p.wait(time.Minute); err != nil {
		t.Fatalf("celery %s: %v\n%s%s", strings.Join(args, " "), err, p.stdout.String(), p.stderr.String())
	}
	return p.stdout.String()
}

// ping runs celery inspect ping --json -d node, again until the node
// answers (a loaded machine may start its control consumer after the
// worker's first log lines) or 30 s pass, and returns the last output.
func (s *stack) ping(t *testing.T, node string) string {
	t.Helper()
	var out string
	testkit.Eventually(30*time.Second, func() bool {
		p := start(t, "celery", s.env, testenv.Python(t), "-m", "celery", "-b", s.env["ONCELER_BROKER_URL"], "inspect", "ping", "--json", "-d", node)
		err := p.wait(time.Minute)
		out = p.stdout.String()
		return err == nil
	})
	return out
}

// TestExampleProject builds docs/example from its own module directory, as a
// user who copied it would, and runs it against RabbitMQ and PostgreSQL: its
// migrate creates the refunds table (twice at once, safely), its worker
// answers Python Celery callers, a duplicate refund is answered from the
// record without a second row, a bad call is quarantined, records and
// quarantine list show them, and Celery's ping reaches its node.
func TestExampleProject(t *testing.T) {
	t.Parallel()
	s := newExampleStack(t)
	bin := exampleBinary(t)
	ctx := context.Background()
	pool := testenv.Pool(t)
	table := pgx.Identifier{s.schema, "refunds"}.Sanitize()

	// Two migrations at once, as two machines deploying together.
	var wg sync.WaitGroup
	migrated := make([]result, 2)
	for i := range migrated {
		wg.Go(func() { migrated[i] = runProg(t, bin, s.env, "migrate") })
	}
	wg.Wait()
	for _, r := range migrated {
		if r.code != 0 || !strings.Contains(r.stdout, `schema "`+s.schema+`" is at version`) {
			t.Fatalf("migrate: exit %d\n%s%s", r.code, r.stdout, r.stderr)
		}
	}
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+table).Scan(&n); err != nil || n != 0 {
		t.Fatalf("refunds table after migrate: %d rows, %v", n, err)
	}

	w := startExampleWorker(t, bin, s.env)
	want := `billing.refund(order-1, 1250) -> {"order_id": "order-1", "refunded": 1250}` + "\n"
	for i := 1; i <= 2; i++ {
		if got := s.callRefund(t, "order-1", 1250); got != want {
			t.Fatalf("call %d: %q, want %q", i, got, want)
		}
	}
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+table+" WHERE order_id = 'order-1' AND cents = 1250").Scan(&n); err != nil || n != 1 {
		t.Fatalf("refunds rows for order-1: %d (%v), want 1: the duplicate ran again", n, err)
	}

	// The task's own error, and arguments it cannot take.
	ids, replies := s.sendTasks(t, time.Minute,
		call{"billing.refund", []any{"order-2", 0}},
		call{"billing.refund", []any{"order-3", "lots"}},
	).replies(2 * time.Minute)
	if len(replies) != 2 || replies[0].Error != "ValueError" || replies[0].Message != "cents must be positive" || replies[1].Error != "TypeError" {
		t.Fatalf("replies to the bad calls: %+v", replies)
	}
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+table).Scan(&n); err != nil || n != 1 {
		t.Fatalf("refunds rows: %d (%v), want only order-1's", n, err)
	}

	r := runProg(t, bin, s.env, "records", "--task", "billing.refund")
	if r.code != 0 {
		t.Fatalf("records: %s", r.stderr)
	}
	if !hasRow(r.stdout, "billing.refund", "order-1", "completed", "1", "1") || !strings.HasSuffix(r.stdout, "1 record(s)\n") {
		t.Fatalf("records does not show order-1 completed once with one duplicate:\n%s", r.stdout)
	}

	r = runProg(t, bin, s.env, "quarantine", "list")
	if r.code != 0 {
		t.Fatalf("quarantine list: %s", r.stderr)
	}
	if !hasRow(r.stdout, ids[1], "billing.refund", "bad_arguments") || !strings.Contains(r.stdout, "1 message(s) in "+s.queue+".quarantine") {
		t.Fatalf("quarantine list does not show the bad call %s:\n%s", ids[1], r.stdout)
	}

	node := nodeOf(t, w)
	out := s.ping(t, node)
	var pong map[string]map[string]string
	if err := json.Unmarshal([]byte(out), &pong); err != nil || pong[node]["ok"] != "pong" || len(pong) != 1 {
		t.Fatalf("celery inspect ping -d %s: %q (%v)", node, out, err)
	}
	w.stop()
}

// hasRow reports whether a line of a table printed by the command starts
// with the given cells.
func hasRow(out string, cells ...string) bool {
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) >= len(cells) && strings.Join(f[:len(cells)], " ") == strings.Join(cells, " ") {
			return true
		}
	}
	return false
}

// docs/tasks.md: a same-database task's failure rolls back with its
// transaction, the claim included: nothing is recorded, and a later copy of
// the operation runs it again.
func TestExampleFailedSameDBOperationIsNotRecorded(t *testing.T) {
	t.Parallel()
	s := newExampleStack(t)
	bin := exampleBinary(t)
	if r := runProg(t, bin, s.env, "migrate"); r.code != 0 {
		t.Fatalf("refunds migrate: exit %d\n%s", r.code, r.stderr)
	}
	w := startExampleWorker(t, bin, s.env)
	_, replies := s.sendTasks(t, time.Minute, call{"billing.refund", []any{"order-v", 0}}, call{"billing.refund", []any{"order-v", 0}}).replies(90 * time.Second)
	w.stop()
	if len(replies) != 2 || replies[0].Error != "ValueError" || replies[1].Error != "ValueError" {
		t.Fatalf("replies %+v, want ValueError twice", replies)
	}
	r := runProg(t, bin, s.env, "records", "--task", "billing.refund", "--key", "order-v", "--json")
	if r.code != 0 {
		t.Fatalf("refunds records: exit %d\n%s", r.code, r.stderr)
	}
	if strings.TrimSpace(r.stdout) != "[]" {
		t.Errorf("refunds records --task billing.refund --key order-v after the ValueError:\n%s\nwant no record, as docs/tasks.md says", r.stdout)
	}
}
