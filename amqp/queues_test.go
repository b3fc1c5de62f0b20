package amqp

import (
	"errors"
	"os/exec"
	"reflect"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// celeryPriorityApp declares its queue as a Celery application does, with
// kombu's Queue and queue_arguments (a priority queue with a dead-letter
// exchange), then sends probe.add with the priorities given, in order.
const celeryPriorityApp = `
import sys
from celery import Celery
from kombu import Exchange, Queue
url, name, dlx = sys.argv[1], sys.argv[2], sys.argv[3]
app = Celery("app", broker=url)
app.conf.task_queues = [Queue(name, Exchange(name), routing_key=name,
                              queue_arguments={"x-max-priority": 10, "x-dead-letter-exchange": dlx})]
app.conf.task_default_queue = name
with app.connection_for_write() as conn:
    app.amqp.queues[name](conn.default_channel).declare()
for p in sys.argv[4:]:
    r = app.signature("probe.add", args=(int(p), 0)).apply_async(priority=int(p))
    print(r.id)
`

// TestExistingQueueServedAsDeclared: a queue the Celery application
// declared with arguments (x-max-priority, x-dead-letter-exchange) is
// consumed with a spec that gives none, with no 406: its arguments are
// learned, the broker hands its messages over highest priority first, and
// after the connection is lost the queue is checked and consumed again.
func TestExistingQueueServedAsDeclared(t *testing.T) {
	cfg := testConfig(t)
	q, dlx := testenv.Name("onceler_amqp_appq"), testenv.Name("onceler_amqp_dlx")
	cleanupQueue(t, q)
	py := testenv.Python(t)
	if out, err := exec.Command(py, "-c", celeryPriorityApp, testenv.AMQPURL(t), q, dlx, "1", "5", "9", "3").CombinedOutput(); err != nil {
		t.Fatalf("celery app: %v\n%s", err, out)
	}
	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQueue(q)}, Prefetch: 1})
	if got := c.Queues(); len(got) != 1 || got[0].Args != nil {
		t.Fatalf("before connecting: %+v, want the configured spec", got)
	}
	got := make(chan *Delivery, 8)
	runConsumer(t, c, func(d *Delivery) { got <- d })
	var order []uint8
	for range 4 {
		d := recv(t, got, 15*time.Second)
		order = append(order, d.Priority)
		must(t, d.Ack(), "ack")
	}
	if !reflect.DeepEqual(order, []uint8{9, 5, 3, 1}) {
		t.Fatalf("priorities delivered in order %v, want 9 5 3 1", order)
	}
	want := map[string]any{"x-max-priority": int32(10), "x-dead-letter-exchange": dlx}
	found := c.Queues()[0]
	if !reflect.DeepEqual(found.Args, want) || !found.Durable || found.IsQuorum() || found.MaxPriority() != 10 {
		t.Fatalf("queue found as %+v, want arguments %v", found, want)
	}

	if n := closeConnection(t, cfg.Name+" consume"); n != 1 {
		t.Fatalf("closed %d consumer connections, want 1", n)
	}
	p := newPublisher(t, cfg)
	ctx := ctxTimeout(t, 30*time.Second)
	testkit.WaitFor(t, "consuming again", 15*time.Second, c.Ready)
	must(t, p.Publish(ctx, q, q, textMessage(`"again"`), PublishOptions{Mandatory: true}), "publish through the exchange")
	if d := recv(t, got, 15*time.Second); string(d.Body) != `"again"` {
		t.Fatalf("after reconnect got %q", d.Body)
	} else {
		must(t, d.Ack(), "ack")
	}
	if again := c.Queues()[0]; !reflect.DeepEqual(again.Args, want) {
		t.Fatalf("after reconnect the queue is found as %+v", again)
	}
	// The publisher's declare finds the same, and Celery still declares
	// its queue over ours without a 406.
	pf, err := p.DeclareQueue(ctx, CeleryQueue(q))
	must(t, err, "publisher declare")
	if !reflect.DeepEqual(pf.Args, want) {
		t.Fatalf("publisher found %+v", pf)
	}
	if out, err := exec.Command(py, "-c", celeryPriorityApp, testenv.AMQPURL(t), q, dlx).CombinedOutput(); err != nil {
		t.Fatalf("celery declares again: %v\n%s", err, out)
	}
}

// TestExistingQueueFlagsAndTypeLearned: a transient classic queue and a
// quorum queue with a length limit, declared by someone else, are consumed
// with plain Celery specs: the quorum queue with per-consumer prefetch
// (global QoS would be refused) and its delivery count; a spec that asks
// for quorum does not turn a classic queue into one.
func TestExistingQueueFlagsAndTypeLearned(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t)
	transient, quorum := testenv.Name("onceler_amqp_tr"), testenv.Name("onceler_amqp_qq")
	cleanupQueue(t, transient, quorum)
	conn, err := amqp091.Dial(testenv.AMQPURL(t))
	must(t, err, "dial")
	defer conn.Close()
	ch, err := conn.Channel()
	must(t, err, "channel")
	_, err = ch.QueueDeclare(transient, false, false, false, false, nil)
	must(t, err, "declare transient")
	_, err = ch.QueueDeclare(quorum, true, false, false, false, amqp091.Table{"x-queue-type": "quorum", "x-max-length": 100})
	must(t, err, "declare quorum")

	asQuorum := CeleryQuorumQueue(transient)
	asQuorum.Exchange = DefaultExchange
	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{asQuorum, CeleryQueue(quorum)}, Prefetch: 2})
	got := make(chan *Delivery, 8)
	runConsumer(t, c, func(d *Delivery) { got <- d })
	testkit.WaitFor(t, "consumer ready", 15*time.Second, c.Ready)
	qs := c.Queues()
	if qs[0].Durable || qs[0].IsQuorum() || qs[0].Args != nil || qs[0].Exchange != DefaultExchange || qs[1].Exchange != quorum {
		t.Fatalf("transient queue found as %+v", qs[0])
	}
	if !qs[1].IsQuorum() || qs[1].Args["x-max-length"] != int32(100) || !qs[1].Durable {
		t.Fatalf("quorum queue found as %+v", qs[1])
	}
	p := newPublisher(t, cfg)
	ctx := ctxTimeout(t, 30*time.Second)
	must(t, p.Publish(ctx, "", quorum, textMessage(`"q"`), PublishOptions{Mandatory: true}), "publish")
	first := recv(t, got, 10*time.Second)
	must(t, first.Nack(true), "requeue")
	second := recv(t, got, 10*time.Second)
	if second.DeliveryCount != 1 {
		t.Fatalf("redelivery from the quorum queue: count %d", second.DeliveryCount)
	}
	must(t, second.Ack(), "ack")
	must(t, c.SetPrefetch(4), "per-consumer prefetch change")
	must(t, p.Publish(ctx, "", transient, textMessage(`"t"`), PublishOptions{Mandatory: true}), "publish")
	must(t, recv(t, got, 10*time.Second).Ack(), "ack transient")
}

// TestMissingQueueDeclaredWithArgs: a missing queue is declared with the
// spec's arguments (the broker then refuses a declare without them), and a
// later declare without them finds them.
func TestMissingQueueDeclaredWithArgs(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t)
	q := testenv.Name("onceler_amqp_args")
	cleanupQueue(t, q)
	p := newPublisher(t, cfg)
	ctx := ctxTimeout(t, 30*time.Second)
	args := map[string]any{"x-max-priority": int64(7), "x-message-ttl": int64(60000), "x-dead-letter-exchange": "dead"}
	spec := CeleryQueue(q)
	spec.Args = args
	made, err := p.DeclareQueue(ctx, spec)
	must(t, err, "declare missing queue")
	if !reflect.DeepEqual(made.Args, args) {
		t.Fatalf("declared %+v", made)
	}
	conn, err := amqp091.Dial(testenv.AMQPURL(t))
	must(t, err, "dial")
	defer conn.Close()
	ch, err := conn.Channel()
	must(t, err, "channel")
	_, err = ch.QueueDeclare(q, true, false, false, false, nil)
	var ae *amqp091.Error
	if !errors.As(err, &ae) || ae.Code != amqp091.PreconditionFailed || !strings.Contains(ae.Reason, "inequivalent arg 'x-") {
		t.Fatalf("declare without the arguments = %v, want 406 naming one", err)
	}
	found, err := p.DeclareQueue(ctx, CeleryQueue(q))
	must(t, err, "declare again without arguments")
	if !sameArgs(found.Args, args) {
		t.Fatalf("found %v, want %v", found.Args, args)
	}
}

func TestParseCurrent(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		key, text string
		v         any
		present   bool
		ok        bool
	}{
		{"x-max-priority", "the value '10' of type 'signedint'", int32(10), true, true},
		{"x-max-length-bytes", "the value '1099511627776' of type 'long'", int64(1099511627776), true, true},
		{"x-dead-letter-routing-key", `the value 'it's "odd" é' of type 'longstr'`, `it's "odd" é`, true, true},
		{"x-single-active-consumer", "the value 'true' of type 'bool'", true, true, true},
		{"x-queue-type", "'quorum'", "quorum", true, true},
		{"durable", "'false'", false, true, true},
		{"x-expires", "none", nil, false, true},
		{"durable", "none", nil, false, false},
		{"x-bindings", "the value '[]' of type 'array'", nil, false, false},
		{"x-max-priority", "the value '1' of type 'signedint", nil, false, false}, // cut short
	} {
		v, present, ok := parseCurrent(c.key, c.text)
		if ok != c.ok || (ok && (present != c.present || !reflect.DeepEqual(v, c.v))) {
			t.Errorf("parseCurrent(%q, %q) = %#v, %t, %t; want %#v, %t, %t", c.key, c.text, v, present, ok, c.v, c.present, c.ok)
		}
	}
	if !sameArgs(map[string]any{"a": int32(1), "b": "x"}, map[string]any{"a": int64(1), "b": "x"}) ||
		sameArgs(map[string]any{"a": 1}, map[string]any{"a": "1"}) {
		t.Error("sameArgs compares integers by value only")
	}
}
