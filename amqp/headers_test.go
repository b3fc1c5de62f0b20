package amqp

import (
	"errors"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// pyPublishShapes publishes, with py-amqp (Celery's client), one message per
// header shape to the default exchange, each with its name as correlation
// id, then a normal message named "after".
const pyPublishShapes = `
import sys, urllib.parse, amqp
u = urllib.parse.urlparse(sys.argv[1])
queue = sys.argv[2]
deep = {"leaf": 1}
for _ in range(40):
    deep = {"d": deep}
shapes = [
    ("before", {"task": "t.ok"}),
    ("L 2**31", {"big": 2**31, "nested": {"big": 2**31}}),
    ("L 2**63-1", {"big": 2**63 - 1}),
    ("L -2**40", {"big": -2**40}),
    ("9000 headers", {"h%d" % i: None for i in range(9000)}),
    ("9000-element array", {"a": [None] * 9000}),
    ("40-deep table", {"deep": deep}),
    ("after", {"task": "t.ok"}),
]
vhost = urllib.parse.unquote(u.path[1:]) or "/"
with amqp.Connection("%s:%d" % (u.hostname, u.port or 5672), userid=u.username or "guest",
                     password=u.password or "guest", virtual_host=vhost) as conn:
    ch = conn.channel()
    for name, headers in shapes:
        msg = amqp.Message(b'{"shape": "%s"}' % name.encode(), content_type="application/json",
                           correlation_id=name, reply_to="caller-replies", application_headers=headers)
        ch.basic_publish(msg, exchange="", routing_key=queue)
`

// Header shapes amqp091-go refuses cost neither the connection nor the
// queue: 64-bit integers of type L are read, the other shapes arrive marked
// unreadable with their properties intact, and the message after them
// flows, on the one connection.
func TestHeaderShapesKeepTheConnection(t *testing.T) {
	t.Parallel()
	py := testenv.Python(t)
	cfg, q, _, _ := declaredQueue(t, "onceler_amqp_shapes", 60*time.Second)
	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQueue(q)}, Prefetch: 4})
	got := make(chan *Delivery, 16)
	runConsumer(t, c, func(d *Delivery) { got <- d })
	testkit.WaitFor(t, "consumer ready", 10*time.Second, c.Ready)

	cmd := exec.Command(py, "-c", pyPublishShapes, testenv.AMQPURL(t), q)
	cmd.Dir = t.TempDir() // not beside our own amqp package
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("py-amqp publish: %v: %s", err, out)
	}

	unreadable := map[string]string{
		"9000 headers":       "more than 8192 entries",
		"9000-element array": "more than 8192 entries",
		"40-deep table":      "nested deeper than 32",
	}
	bigs := map[string]int64{"L 2**31": 1 << 31, "L 2**63-1": 1<<63 - 1, "L -2**40": -(1 << 40)}
	order := []string{"before", "L 2**31", "L 2**63-1", "L -2**40", "9000 headers", "9000-element array", "40-deep table", "after"}
	for _, name := range order {
		d := recv(t, got, 10*time.Second)
		if d.CorrelationID != name || d.ReplyTo != "caller-replies" || !strings.Contains(string(d.Body), name) {
			t.Fatalf("delivery %q (reply_to %q, body %q), want %q", d.CorrelationID, d.ReplyTo, d.Body, name)
		}
		switch reason, bad := unreadable[name]; {
		case bad:
			if d.HeadersError == nil || !strings.Contains(d.HeadersError.Error(), reason) || d.Headers != nil {
				t.Errorf("%s: HeadersError %v, headers %d; want %q and none", name, d.HeadersError, len(d.Headers), reason)
			}
			if _, err := celeryproto.Decode(&d.Delivery); !errors.Is(err, celeryproto.ErrBadHeader) {
				t.Errorf("%s: Decode: %v, want ErrBadHeader", name, err)
			}
		default:
			if d.HeadersError != nil {
				t.Errorf("%s: HeadersError %v", name, d.HeadersError)
			}
		}
		if want, ok := bigs[name]; ok && d.Headers["big"] != want {
			t.Errorf("%s: big = %#v, want int64 %d", name, d.Headers["big"], want)
		}
		if name == "L 2**31" {
			if n, _ := d.Headers["nested"].(map[string]any); n["big"] != int64(1<<31) {
				t.Errorf("nested big = %#v", d.Headers["nested"])
			}
		}
		must(t, d.Ack(), "ack %s", name)
	}
	testkit.WaitFor(t, "queue empty", 5*time.Second, func() bool { return testkit.QueueDepth(t, testenv.AMQPURL(t), q) == 0 })
	if n := c.gen.Load(); n != 1 {
		t.Fatalf("%d consumer sessions, want 1: the connection was lost", n)
	}
}
