package cmd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// appPy is a Celery application that declares its queue as kombu does,
// with queue arguments (a priority queue with a dead-letter exchange), then
// sends calls with apply_async(priority=...) and prints one JSON line per
// id, then one per result, in order.
const appPy = `
import json, os, sys
from celery import Celery
from kombu import Exchange, Queue
queue, dlx, timeout, calls = sys.argv[1], sys.argv[2], float(sys.argv[3]), json.loads(sys.argv[4])
app = Celery("app", broker=os.environ["ONCELER_BROKER_URL"], backend="rpc://")
app.conf.task_queues = [Queue(queue, Exchange(queue), routing_key=queue,
                              queue_arguments={"x-max-priority": 10, "x-dead-letter-exchange": dlx})]
app.conf.task_default_queue = queue
with app.connection_for_write() as conn:
    app.amqp.queues[queue](conn.default_channel).declare()
sent = [app.signature(name, args=args).apply_async(priority=priority) for name, args, priority in calls]
` + printResultsPy

// prioritized is a call sent by appPy with a priority.
type prioritized struct {
	call
	priority int
}

// sendApp starts appPy: it declares s.queue as the application does, then
// sends the calls; it returns once they are all sent.
func (s *stack) sendApp(t *testing.T, dlx string, calls ...prioritized) *proc {
	t.Helper()
	list := make([][]any, len(calls))
	for i, c := range calls {
		list[i] = []any{c.Task, c.Args, c.priority}
	}
	b, _ := json.Marshal(list)
	p := start(t, "celery app", s.env, testenv.Python(t), "-c", appPy, s.queue, dlx, "90", string(b))
	deadline := time.Now().Add(60 * time.Second)
	for strings.Count(p.stdout.String(), `{"id"`) < len(calls) {
		select {
		case <-p.done:
			t.Fatalf("celery app exited (%v) before sending:\n%s", p.err, p.stderr.String())
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("celery app did not send within 60s:\n%s", p.stderr.String())
		}
	}
	return p
}

// activeQueuesPy asks one node for active_queues, as 'celery inspect
// active_queues' does.
const activeQueuesPy = `
import json, os, sys
from celery import Celery
app = Celery("inspect", broker=os.environ["ONCELER_BROKER_URL"])
print(json.dumps(app.control.inspect(destination=[sys.argv[1]], timeout=3).active_queues()))
`

// TestWorkerServesTheApplicationsQueue: a Celery application declares its
// queue with x-max-priority and a dead-letter exchange and sends tasks with
// priorities; 'onceler worker' started without any flag serves it (no 406),
// the callers get their results, 'celery inspect active_queues' shows the
// queue's arguments, and the prefetch defaults to the concurrency.
func TestWorkerServesTheApplicationsQueue(t *testing.T) {
	t.Parallel()
	s := newStack(t)
	dlx := testenv.Name("dlx")
	sender := s.sendApp(t, dlx,
		prioritized{call{demo.TaskAdd, []any{1, 2}}, 0},
		prioritized{call{demo.TaskAdd, []any{3, 4}}, 9},
		prioritized{call{demo.TaskAdd, []any{5, 6}}, 4})
	w := startWorker(t, s.env, "--concurrency", "3")
	_, replies := sender.replies(90 * time.Second)
	var got []string
	for _, r := range replies {
		got = append(got, fmt.Sprint(r.OK))
	}
	if !reflect.DeepEqual(got, []string{"3", "7", "11"}) {
		t.Fatalf("replies %+v", replies)
	}
	w.waitLog(`"priority_queues":["`+s.queue+`"],"prefetch":3`, 10*time.Second)

	host, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	node := fmt.Sprintf("onceler-%d@%s", w.cmd.Process.Pid, host)
	p := start(t, "celery inspect active_queues", s.env, testenv.Python(t), "-c", activeQueuesPy, node)
	if err := p.wait(60 * time.Second); err != nil {
		t.Fatalf("inspect: %v\n%s", err, p.stderr.String())
	}
	var answer map[string][]map[string]any
	if err := json.Unmarshal([]byte(p.stdout.String()), &answer); err != nil || len(answer[node]) != 1 {
		t.Fatalf("active_queues %q: %v", p.stdout.String(), err)
	}
	q := answer[node][0]
	want := map[string]any{"x-max-priority": 10.0, "x-dead-letter-exchange": dlx}
	if q["name"] != s.queue || q["routing_key"] != s.queue || q["durable"] != true || !reflect.DeepEqual(q["queue_arguments"], want) {
		t.Fatalf("active_queues of %s = %v, want queue_arguments %v", node, q, want)
	}
	w.stop()
}

// TestWorkerRunsHigherPrioritiesFirst: with the worker stopped, the Celery
// application sends three low-priority credits, then three high-priority
// ones; a worker started with --concurrency 1 --prefetch 1 runs the high
// ones first, as the broker hands them over: the balances the callers get
// and the ledger's order say so.
func TestWorkerRunsHigherPrioritiesFirst(t *testing.T) {
	t.Parallel()
	s := newStack(t)
	acct := testenv.Name("acct")
	var calls []prioritized
	for i := range 3 {
		calls = append(calls, prioritized{call{demo.TaskCredit, []any{acct, fmt.Sprintf("%s-low-%d", acct, i), 1}}, 1})
	}
	for i := range 3 {
		calls = append(calls, prioritized{call{demo.TaskCredit, []any{acct, fmt.Sprintf("%s-high-%d", acct, i), 100}}, 9})
	}
	sender := s.sendApp(t, testenv.Name("dlx"), calls...)
	w := startWorker(t, s.env, "--concurrency", "1", "--prefetch", "1")
	_, replies := sender.replies(90 * time.Second)
	w.stop()
	var balances []string
	for _, r := range replies {
		m, _ := r.OK.(map[string]any)
		balances = append(balances, fmt.Sprint(m["balance"]))
	}
	// Sent low, low, low, high, high, high; run high, high, high, low, low, low.
	if want := []string{"301", "302", "303", "100", "200", "300"}; !reflect.DeepEqual(balances, want) {
		t.Fatalf("balances %v, want %v (the high-priority credits first)", balances, want)
	}
	pool := testenv.Pool(t)
	rows, err := pool.Query(context.Background(), `SELECT entry_id FROM onceler_demo.ledger WHERE account = $1 ORDER BY created_at`, acct)
	if err != nil {
		t.Fatal(err)
	}
	var order []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		order = append(order, strings.TrimPrefix(id, acct+"-"))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if want := []string{"high-0", "high-1", "high-2", "low-0", "low-1", "low-2"}; !reflect.DeepEqual(order, want) {
		t.Fatalf("ledger order %v, want %v", order, want)
	}
}

// TestWorkerDeclaresMissingQueuesWithQueueArg: queues that do not exist are
// declared with --queue-arg's arguments, those without a queue for all of
// --queues, those with one for that queue only; the broker then accepts a
// declare with exactly those arguments and refuses one without each.
func TestWorkerDeclaresMissingQueuesWithQueueArg(t *testing.T) {
	t.Parallel()
	s := newStack(t)
	other := testenv.Name("q")
	url := testenv.AMQPURL(t)
	t.Cleanup(func() { testkit.DeleteQueues(t, url, other, other+".quarantine") })
	w := startWorker(t, s.env, "--queues", s.queue+","+other, "--queue-arg", "x-max-priority=5",
		"--queue-arg", s.queue+":x-message-ttl=600000,"+other+`:x-dead-letter-exchange="7"`)
	w.waitLog(`"priority_queues":["`+s.queue+`","`+other+`"]`, 10*time.Second)
	w.stop()
	for q, args := range map[string]amqp091.Table{
		s.queue: {"x-max-priority": int64(5), "x-message-ttl": int64(600000)},
		other:   {"x-max-priority": int64(5), "x-dead-letter-exchange": "7"},
	} {
		if err := declareWith(url, q, args); err != nil {
			t.Fatalf("%s declared with %v: %v", q, args, err)
		}
		for k := range args {
			less := amqp091.Table{}
			for k2, v := range args {
				if k2 != k {
					less[k2] = v
				}
			}
			err := declareWith(url, q, less)
			var ae *amqp091.Error
			if !errors.As(err, &ae) || ae.Code != amqp091.PreconditionFailed || !strings.Contains(ae.Reason, "'"+k+"'") {
				t.Fatalf("%s declared without %s: %v, want 406 naming it", q, k, err)
			}
		}
	}
}

// declareWith declares the durable queue q with args on a connection of
// its own.
func declareWith(url, q string, args amqp091.Table) error {
	conn, err := amqp091.Dial(url)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	_, err = ch.QueueDeclare(q, true, false, false, false, args)
	return err
}

// TestWorkerRefusedQueueArg: arguments the broker refuses for a missing
// queue stop the worker at start with one line that names the flags.
func TestWorkerRefusedQueueArg(t *testing.T) {
	t.Parallel()
	s := newStack(t)
	r := runBin(t, s.env, "worker", "--migrate", "--queue-arg", "x-max-priority=high")
	line := oneLineError(t, r, 1)
	for _, want := range []string{"queue " + s.queue + " is missing on", "check --queue-arg and --quorum", "x-max-priority"} {
		if !strings.Contains(line, want) {
			t.Fatalf("line %q lacks %q", line, want)
		}
	}
}

func TestParseQueueArgs(t *testing.T) {
	t.Parallel()
	got, err := parseQueueArgs("worker", []string{"x-max-priority=10", "a:x-message-ttl=60000", "b=c:x-dead-letter-exchange=dl:x",
		"x-single-active-consumer=true", `a:x-dead-letter-routing-key="42"`, "a:x-max-priority=3", "x-overflow=reject-publish"},
		[]string{"a", "b=c"})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]map[string]any{
		"a": {"x-max-priority": int64(3), "x-message-ttl": int64(60000), "x-single-active-consumer": true,
			"x-dead-letter-routing-key": "42", "x-overflow": "reject-publish"},
		"b=c": {"x-max-priority": int64(10), "x-dead-letter-exchange": "dl:x", "x-single-active-consumer": true,
			"x-overflow": "reject-publish"},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("parseQueueArgs = %v\nwant %v", got, want)
	}
	for _, bad := range []string{"novalue", "=1", "c:x-max-priority=1"} {
		if _, err := parseQueueArgs("worker", []string{bad}, []string{"a"}); err == nil {
			t.Errorf("parseQueueArgs(%q) accepted", bad)
		}
	}
}

// TestQueueArgFlagRepeatsAndEnvironment: --queue-arg repeats and splits at
// commas; the command line replaces ONCELER_QUEUE_ARG.
func TestQueueArgFlagRepeatsAndEnvironment(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		env  string
		args []string
		want []string
	}{
		{"", []string{"--queue-arg", "a=1", "--queue-arg", "b=2,c=3"}, []string{"a=1", "b=2", "c=3"}},
		{"x=1,y=2", nil, []string{"x=1", "y=2"}},
		{"x=1", []string{"--queue-arg", "a=1"}, []string{"a=1"}},
	} {
		f := &workerFlags{}
		fs := newFlagSet(&command{name: "worker"})
		fs.List(&f.queueArgs, "queue-arg", "", "")
		if err := fs.applyEnv(func(k string) string {
			if k == "ONCELER_QUEUE_ARG" {
				return c.env
			}
			return ""
		}); err != nil {
			t.Fatal(err)
		}
		if _, err := fs.parse(c.args); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(f.queueArgs, c.want) {
			t.Errorf("env %q args %v: %v, want %v", c.env, c.args, f.queueArgs, c.want)
		}
	}
}

// TestEdgeQueueArgValueWithColonAndEquals: queueArgItem's comment says a
// value may hold anything but ','; a value holding ':' and then '=' (a
// dead-letter routing key "tenant:a=b") must be read as the value of an
// argument for every queue, not as a queue name "x-...=tenant" that is
// not among --queues. Quoting the value does not help either.
func TestEdgeQueueArgValueWithColonAndEquals(t *testing.T) {
	t.Parallel()
	names := []string{"orders"}
	for item, want := range map[string]map[string]map[string]any{
		"x-dead-letter-routing-key=tenant:a=b":        {"orders": {"x-dead-letter-routing-key": "tenant:a=b"}},
		`x-dead-letter-routing-key="tenant:a=b"`:      {"orders": {"x-dead-letter-routing-key": "tenant:a=b"}},
		"orders:x-dead-letter-routing-key=tenant:a=b": {"orders": {"x-dead-letter-routing-key": "tenant:a=b"}},
		`orders:x-dead-letter-exchange="dlx:v=2"`:     {"orders": {"x-dead-letter-exchange": "dlx:v=2"}},
	} {
		got, err := parseQueueArgs("worker", []string{item}, names)
		if err != nil || !reflect.DeepEqual(got, want) {
			t.Errorf("parseQueueArgs(%q) = %v, %v; want %v", item, got, err, want)
		}
	}
}
