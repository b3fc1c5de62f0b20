package integration

import (
	"bytes"
	"context"
	"os/exec"
	"strings"
	"testing"

	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// pyRetryViaDeadLetter sets up, as guest, a queue bound to a fanout
// dead-letter exchange and a source queue that dead-letters to it at once
// (x-message-ttl 0), waits for the worker to consume the first, publishes
// a demo.flaky task that fails once to the source queue, and prints the
// statuses answered to its reply queue within 40 s, one a line. argv:
// broker URL, queue, dead-letter exchange, source queue, reply queue, task
// id.
const pyRetryViaDeadLetter = `
import sys, time, json, urllib.parse, amqp
u = urllib.parse.urlparse(sys.argv[1])
queue, dlx, source, reply, tid = sys.argv[2:7]
vhost = urllib.parse.unquote(u.path[1:]) or "/"
with amqp.Connection("%s:%d" % (u.hostname, u.port or 5672), userid=u.username or "guest",
                     password=u.password or "guest", virtual_host=vhost) as conn:
    ch = conn.channel()
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
                     exchange="", routing_key=source)
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

// TestRetryOfDeadLetteredMessageWithPrintedPermissions: a task that
// reaches the worker's queue through a dead-letter exchange (a delay
// queue's expired message, say) and asks for a Celery retry: the retry
// goes back to the queue through the default exchange, so the worker
// whose user has what 'onceler permissions --queues q' prints (no write
// on the dead-letter exchange) answers RETRY, then SUCCESS.
func TestRetryOfDeadLetteredMessageWithPrintedPermissions(t *testing.T) {
	t.Parallel()
	py := testenv.Python(t)
	b := newBrokerUser(t)
	pool := testenv.Pool(t)
	queue, node, dlx, source := testkit.Name("q"), testkit.Name("n"), testkit.Name("dlx"), testkit.Name("s")
	reply, id := testkit.Name("r"), testkit.NewID()
	b.grant(t, b.printed(t, "--queues", queue, "--hostname", node+"@%h"))

	setup := exec.Command(py, "-c", `
import sys, urllib.parse, amqp
u = urllib.parse.urlparse(sys.argv[1])
vhost = urllib.parse.unquote(u.path[1:]) or "/"
queue, dlx, source = sys.argv[2:5]
with amqp.Connection("%s:%d" % (u.hostname, u.port or 5672), userid=u.username, password=u.password, virtual_host=vhost) as conn:
    ch = conn.channel()
    ch.exchange_declare(dlx, "fanout", durable=True, auto_delete=False)
    ch.queue_declare(queue, durable=True, auto_delete=False)
    ch.queue_bind(queue, dlx, routing_key="")
    ch.queue_declare(source, durable=True, auto_delete=False,
                     arguments={"x-dead-letter-exchange": dlx, "x-message-ttl": 0})
`, b.suiteURL, queue, dlx, source)
	if out, err := setup.CombinedOutput(); err != nil {
		t.Fatalf("setup: %v\n%s", err, out)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
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
	pc := exec.Command(py, "-c", pyRetryViaDeadLetter, b.suiteURL, queue, dlx, source, reply, id)
	pc.Stdout, pc.Stderr = &out, &out
	perr := pc.Run()
	statuses := strings.Fields(out.String())
	if perr != nil || len(statuses) < 2 || statuses[0] != "RETRY" || statuses[len(statuses)-1] != "SUCCESS" {
		t.Fatalf("dead-lettered task answered %q (%v), want RETRY then SUCCESS\npython:\n%s\nworker log:\n%s", statuses, perr, out.String(), log.String())
	}
	if strings.Contains(log.String(), "ACCESS_REFUSED") {
		t.Fatalf("the worker met a refusal:\n%s", log.String())
	}
}
