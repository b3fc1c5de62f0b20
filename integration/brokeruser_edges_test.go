package integration

import (
	"bytes"
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// pyRetryViaOwnExchange sets up, as guest, a Celery queue routed by an
// exchange of its own (kombu.Queue(q, Exchange(x, "topic"), routing_key=q)),
// waits for the worker to consume the queue, publishes a demo.flaky task
// that fails once and asks for a retry through that exchange, as a Celery
// client does, and prints the statuses answered to its reply queue within
// 40 s, one a line. argv: broker URL, queue, exchange, reply queue, task id.
const pyRetryViaOwnExchange = `
import sys, time, json, urllib.parse, amqp
u = urllib.parse.urlparse(sys.argv[1])
queue, exchange, reply, tid = sys.argv[2:6]
vhost = urllib.parse.unquote(u.path[1:]) or "/"
with amqp.Connection("%s:%d" % (u.hostname, u.port or 5672), userid=u.username or "guest",
                     password=u.password or "guest", virtual_host=vhost) as conn:
    ch = conn.channel()
    ch.exchange_declare(exchange, "topic", durable=True, auto_delete=False)
    ch.queue_declare(queue, durable=True, auto_delete=False)
    ch.queue_bind(queue, exchange, routing_key=queue)
    ch.queue_declare(reply, durable=False, auto_delete=False)
    deadline = time.time() + 60
    while ch.queue_declare(queue, passive=True).consumer_count == 0:
        if time.time() > deadline:
            print("no consumer"); sys.exit(2)
        time.sleep(0.3)
    headers = {"lang": "py", "task": "demo.flaky", "id": tid, "root_id": tid, "retries": 0}
    body = json.dumps([[], {"op": tid, "failures": 1}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}])
    ch.basic_publish(amqp.Message(body.encode(), content_type="application/json", content_encoding="utf-8",
                                  correlation_id=tid, reply_to=reply, application_headers=headers, delivery_mode=2),
                     exchange=exchange, routing_key=queue)
    deadline = time.time() + 40
    while time.time() < deadline:
        m = ch.basic_get(reply, no_ack=True)
        if m is None:
            time.sleep(0.3); continue
        status = json.loads(m.body)["status"]
        print(status, flush=True)
        if status in ("SUCCESS", "FAILURE"):
            break
`

// TestRetryThroughQueuesOwnExchangeWithPrintedPermissions: a Celery queue
// whose producers route by an exchange of its own (kombu.Queue(q,
// Exchange("tasks"))): the worker, whose user has what 'onceler
// permissions --queues q' prints, starts, but its Celery retry goes back
// by the exchange the message came by, on which the printed permissions
// give no write; the start-up write check looked only at the exchange
// named after the queue. Want: the retried task succeeds, or the worker
// refuses to start naming the permission.
func TestRetryThroughQueuesOwnExchangeWithPrintedPermissions(t *testing.T) {
	t.Parallel()
	py := testenv.Python(t)
	b := newBrokerUser(t)
	pool := testenv.Pool(t)
	queue, node, exchange := testkit.Name("q"), testkit.Name("n"), testkit.Name("x")
	reply, id := testkit.Name("r"), testkit.NewID()
	b.grant(t, b.printed(t, "--queues", queue, "--hostname", node+"@%h"))

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// The producers' exchange and binding exist before the worker starts.
	setup := exec.Command(py, "-c", `
import sys, urllib.parse, amqp
u = urllib.parse.urlparse(sys.argv[1])
vhost = urllib.parse.unquote(u.path[1:]) or "/"
with amqp.Connection("%s:%d" % (u.hostname, u.port or 5672), userid=u.username, password=u.password, virtual_host=vhost) as conn:
    ch = conn.channel()
    ch.exchange_declare(sys.argv[3], "topic", durable=True, auto_delete=False)
    ch.queue_declare(sys.argv[2], durable=True, auto_delete=False)
    ch.queue_bind(sys.argv[2], sys.argv[3], routing_key=sys.argv[2])
`, b.suiteURL, queue, exchange)
	if out, err := setup.CombinedOutput(); err != nil {
		t.Fatalf("setup: %v\n%s", err, out)
	}
	cmd := exec.CommandContext(ctx, oncelerBin, "worker", "--migrate", "--queues", queue, "--hostname", node+"@%h")
	cmd.Env = []string{"PATH=/usr/bin:/bin", "ONCELER_BROKER_URL=" + b.workerURL, "ONCELER_DATABASE_URL=" + testenv.DatabaseURL(t),
		"ONCELER_SCHEMA=" + testenv.Schema(t, pool)}
	log := &lockedBuffer{}
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	defer func() { cancel(); <-done }()

	var out bytes.Buffer
	pc := exec.Command(py, "-c", pyRetryViaOwnExchange, b.suiteURL, queue, exchange, reply, id)
	pc.Stdout, pc.Stderr = &out, &out
	perr := pc.Run()
	select {
	case <-done:
		if strings.Contains(log.String(), "RabbitMQ refused") {
			t.Logf("the worker refused to start: %s", log.String())
			return // refused at start, naming the permission: acceptable
		}
	default:
	}
	statuses := strings.Fields(out.String())
	if perr != nil || len(statuses) == 0 || statuses[len(statuses)-1] != "SUCCESS" {
		refused := ""
		for _, l := range strings.Split(log.String(), "\n") {
			if strings.Contains(l, "ACCESS_REFUSED") || strings.Contains(l, "refused") {
				refused = l
				break
			}
		}
		t.Fatalf("retried task answered %q (%v), want RETRY then SUCCESS; the worker started with the printed permissions and met, at run time:\n%s\npython:\n%s",
			statuses, perr, refused, out.String())
	}
}

// TestTopicPermissionsOnEventsLetTheWorkerStart: an operator who also
// limits the routing keys the user may publish to celeryev (rabbitmqctl
// set_topic_permissions) to those Celery's events use, worker.* and
// task.*, gives the worker all it publishes there. The start-up write
// check publishes to celeryev with the routing key
// "onceler.access-check", which RabbitMQ refuses by the topic permission:
// want the worker to start and answer a ping, not exit at start over a
// routing key it never uses.
func TestTopicPermissionsOnEventsLetTheWorkerStart(t *testing.T) {
	t.Parallel()
	py := testenv.Python(t)
	b := newBrokerUser(t)
	pool := testenv.Pool(t)
	queue, node := testkit.Name("q"), testkit.Name("n")
	b.grant(t, b.printed(t, "--queues", queue, "--hostname", node+"@%h"))
	rabbitmqctl(t, "set_topic_permissions", "-p", b.vhost, b.user, "celeryev", `^(worker|task)\.`, `^(worker|task)\.`)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cmd := exec.CommandContext(ctx, oncelerBin, "worker", "--migrate", "--queues", queue, "--hostname", node+"@%h", "--events")
	cmd.Env = []string{"PATH=/usr/bin:/bin", "ONCELER_BROKER_URL=" + b.workerURL, "ONCELER_DATABASE_URL=" + testenv.DatabaseURL(t),
		"ONCELER_SCHEMA=" + testenv.Schema(t, pool)}
	log := &lockedBuffer{}
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	defer func() { cancel(); <-done }()
	deadline := time.Now().Add(60 * time.Second)
	for {
		out, err := exec.Command(py, "-c", pingPy, b.suiteURL, node).CombinedOutput()
		if err == nil && strings.Contains(string(out), "pong") {
			return
		}
		select {
		case <-done:
			lines := strings.Split(strings.TrimSpace(log.String()), "\n")
			t.Fatalf("the worker, with the printed permissions and celeryev's topic permissions limited to worker.* and task.*, exited %d at start:\n%s",
				cmd.ProcessState.ExitCode(), lines[len(lines)-1])
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("no pong from %s: %v %s\nworker log:\n%s", node, err, out, log.String())
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// TestDeadLetterQueueArgRefusalNamesWritePermission: a worker declaring
// its queue with --queue-arg x-dead-letter-exchange=<dlx> needs, besides
// configure on the queue, write on the dead-letter exchange (RabbitMQ
// checks it on queue.declare), which 'onceler permissions --queues q'
// does not print. The worker stops at start; its line must name the
// permission RabbitMQ refused: write on exchange <dlx>.
func TestDeadLetterQueueArgRefusalNamesWritePermission(t *testing.T) {
	t.Parallel()
	b := newBrokerUser(t)
	pool := testenv.Pool(t)
	queue, node, dlx := testkit.Name("q"), testkit.Name("n"), testkit.Name("dlx")
	b.grant(t, b.printed(t, "--queues", queue, "--hostname", node+"@%h"))
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, oncelerBin, "worker", "--migrate", "--queues", queue, "--hostname", node+"@%h",
		"--queue-arg", "x-dead-letter-exchange="+dlx, "--log-level", "error")
	cmd.Env = []string{"PATH=/usr/bin:/bin", "ONCELER_BROKER_URL=" + b.workerURL, "ONCELER_DATABASE_URL=" + testenv.DatabaseURL(t),
		"ONCELER_SCHEMA=" + testenv.Schema(t, pool)}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	_ = cmd.Run()
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	last := lines[len(lines)-1]
	want := `onceler: RabbitMQ refused user "` + b.user + `" write access to exchange '` + dlx + `'`
	if cmd.ProcessState == nil || cmd.ProcessState.ExitCode() != 1 || !strings.HasPrefix(last, want) {
		t.Fatalf("exit %v, last line:\n%s\nwant exit 1 and a line starting %q", cmd.ProcessState, last, want)
	}
}
