package cmd

import (
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/onceler/onceler/internal/testenv"
)

// outputPages are the pages that show the walkthrough's outputs: the README
// has most of them, docs/operations.md the purge dry run, docs/tasks.md the
// example binary seen as a Celery node and in the record.
var outputPages = []string{"../README.md", "../docs/operations.md", "../docs/tasks.md"}

// readmeBlocks returns the expected outputs of the walkthrough: each ```text
// block after a <!-- output: NAME --> marker in the outputPages, with the
// page each came from.
func readmeBlocks(t *testing.T) map[string]block {
	t.Helper()
	re := regexp.MustCompile("(?s)<!-- output: ([a-z-]+) -->\n```text\n(.*?)```")
	out := map[string]block{}
	for _, page := range outputPages {
		b, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range re.FindAllStringSubmatch(string(b), -1) {
			if prev, ok := out[m[1]]; ok {
				t.Fatalf("output block %q is in %s and in %s", m[1], prev.page, page)
			}
			out[m[1]] = block{page: strings.TrimPrefix(page, "../"), text: m[2]}
		}
	}
	return out
}

// block is an expected output and the page that shows it.
type block struct{ page, text string }

func sameOutput(t *testing.T, name, got string, want block) {
	t.Helper()
	if want.text == "" {
		t.Fatalf("no output block %q in %v", name, outputPages)
	}
	if got != want.text {
		t.Errorf("%s output %q differs from the real one.\n%s:\n%s\nreal:\n%s", want.page, name, want.page, want.text, got)
	}
}

// TestReadmeWalkthrough follows the README's walkthrough with the built
// binary and the shipped Python script, on a record schema and queue of its
// own, and checks that every output shown in the README (and the purge dry
// run in docs/operations.md) is what really comes out.
func TestReadmeWalkthrough(t *testing.T) {
	t.Parallel()
	s := newStack(t)
	// The pool size the README recommends setting in the URL: the worker
	// and the script read the same variable.
	sep := "?"
	if strings.Contains(s.env["ONCELER_DATABASE_URL"], "?") {
		sep = "&"
	}
	s.env["ONCELER_DATABASE_URL"] += sep + "pool_max_conns=8"
	want := readmeBlocks(t)
	py := testenv.Python(t)
	prefix := testenv.Name("w") + "-"
	script := func(args ...string) *proc {
		return start(t, "walkthrough.py", s.env, py, append([]string{"../scripts/walkthrough.py", "--queue", s.queue, "--prefix", prefix}, args...)...)
	}

	w := startWorker(t, s.env)
	walk := script()
	if err := walk.wait(3 * time.Minute); err != nil {
		t.Fatalf("walkthrough.py: %v\n%s", err, walk.stderr.String())
	}
	sameOutput(t, "walkthrough", walk.stdout.String(), want["walkthrough"])

	r := runBin(t, s.env, "repeats", "--since", "1h")
	if r.code != 0 {
		t.Fatalf("repeats: %s", r.stderr)
	}
	sameOutput(t, "repeats", r.stdout, want["repeats"])

	time.Sleep(1100 * time.Millisecond)
	r = runBin(t, s.env, "purge", "--older-than", "1s", "--dry-run")
	if r.code != 0 {
		t.Fatalf("purge: %s", r.stderr)
	}
	sameOutput(t, "purge", r.stdout, want["purge"])
	w.stop()

	crashEnv := s.with(map[string]string{"ONCELER_CRASH_AT": "after_effect", "ONCELER_CRASH_TASK": "demo.payments.charge"})
	w = startWorker(t, crashEnv, "--lease", "5s")
	crash := script("crash")
	_ = w.wait(2 * time.Minute)
	if !w.killed() {
		t.Fatalf("worker was not killed by the crash injection: %v", w.err)
	}
	w = startWorker(t, s.env, "--lease", "5s")
	if err := crash.wait(2 * time.Minute); err != nil {
		t.Fatalf("walkthrough.py crash: %v\n%s", err, crash.stderr.String())
	}
	sameOutput(t, "crash", crash.stdout.String(), want["crash"])

	// Again: every answer with an effect comes from the record.
	again := script()
	if err := again.wait(3 * time.Minute); err != nil {
		t.Fatalf("walkthrough.py again: %v\n%s", err, again.stderr.String())
	}
	sameOutput(t, "walkthrough (again)", again.stdout.String(), want["walkthrough"])
	w.stop()

	r = runBin(t, s.env, "repeats", "--since", "1h", "--json")
	if !strings.Contains(r.stdout, `"task": "demo.payments.charge",`) || !strings.Contains(r.stdout, `"takeovers": 1,`) {
		t.Fatalf("repeats after the crash shows no takeover:\n%s", r.stdout)
	}
}

// TestNoRecordRepeatsEffects runs the walkthrough against a worker started
// with --no-record: every copy runs, as the README says.
func TestNoRecordRepeatsEffects(t *testing.T) {
	t.Parallel()
	s := newStack(t)
	w := startWorker(t, s.env, "--no-record")
	if !strings.Contains(w.stderr.String(), "--no-record: running every task WITHOUT the idempotency record") {
		t.Fatalf("no loud warning:\n%s", w.stderr.String())
	}
	walk := start(t, "walkthrough.py", s.env, testenv.Python(t), "../scripts/walkthrough.py", "--queue", s.queue, "--prefix", testenv.Name("n")+"-")
	if err := walk.wait(3 * time.Minute); err != nil {
		t.Fatalf("walkthrough.py: %v\n%s", err, walk.stderr.String())
	}
	w.stop()
	out := walk.stdout.String()
	for _, want := range []string{
		`demo.ledger.credit(acct-1, e-2, 250)         -> {"account": "acct-1", "balance": 4750, "entry_id": "e-2"}`,
		"ledger rows for e-1                3",
		"gateway calls for order-1          3",
		"gateway charges for order-1        1",
		"emails sent for msg-1              3",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("without the record, output misses %q:\n%s", want, out)
		}
	}
}

// TestReadmeOwnBinary follows the README's section on writing a task in Go:
// it builds docs/example in its own directory, runs its migrate, worker,
// call.py twice, Celery's ping and records, on a schema and queue of its
// own, and checks that every output shown is what really comes out (the
// schema, node name and time replaced by the README's).
func TestReadmeOwnBinary(t *testing.T) {
	t.Parallel()
	s := newExampleStack(t)
	want := readmeBlocks(t)
	bin := exampleBinary(t)

	r := runProg(t, bin, s.env, "migrate")
	if r.code != 0 {
		t.Fatalf("migrate: %s", r.stderr)
	}
	sameOutput(t, "refunds-migrate", strings.ReplaceAll(r.stdout, `"`+s.schema+`"`, `"onceler"`), want["refunds-migrate"])

	w := startExampleWorker(t, bin, s.env)
	calls := s.callRefund(t, "order-7", 1250) + s.callRefund(t, "order-7", 1250)
	sameOutput(t, "refunds-call", calls, want["refunds-call"])

	// Other workers may share the broker: ask this one only.
	node := nodeOf(t, w)
	ping := s.celery(t, "inspect", "ping", "-d", node)
	sameOutput(t, "refunds-ping", strings.ReplaceAll(ping, node, "onceler-4242@myhost"), want["refunds-ping"])

	r = runProg(t, bin, s.env, "records", "--task", "billing.refund")
	if r.code != 0 {
		t.Fatalf("records: %s", r.stderr)
	}
	sameOutput(t, "refunds-records", readmeTime.ReplaceAllString(r.stdout, "2026-01-02 03:04:05"), want["refunds-records"])
	w.stop()
}

// readmeTime is a time as the commands print it.
var readmeTime = regexp.MustCompile(`\d{4}-\d\d-\d\d \d\d:\d\d:\d\d`)
