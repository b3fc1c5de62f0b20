package amqp

import (
	"errors"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// Celery declares its queue exactly as Celery's app.amqp does, then sends a
// task there; quorum=True uses queue_arguments={"x-queue-type": "quorum"}.
const celerySend = `
import sys
from celery import Celery
from kombu import Exchange, Queue
url, name = sys.argv[1], sys.argv[2]
quorum = len(sys.argv) > 3
app = Celery("probe", broker=url)
args = {"x-queue-type": "quorum"} if quorum else None
app.conf.task_queues = [Queue(name, Exchange(name), routing_key=name, queue_arguments=args)]
app.conf.task_default_queue = name
with app.connection_for_write() as conn:
    app.amqp.queues[name](conn.default_channel).declare()
    r = app.send_task("probe.add", args=(2, 3), kwargs={"z": 1}, queue=name, connection=conn)
print(r.id)
`

func celerySendTask(t *testing.T, queue string, quorum bool) string {
	t.Helper()
	py := testenv.Python(t)
	args := []string{"-c", celerySend, testenv.AMQPURL(t), queue}
	if quorum {
		args = append(args, "quorum")
	}
	out, err := exec.Command(py, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("celery send_task: %v\n%s", err, out)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	return lines[len(lines)-1]
}

// Our declaration of a Celery queue and Celery's own agree, in either order,
// and a task Celery sends arrives with its protocol-2 headers intact.
func TestCeleryQueueMatchesKombu(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t)
	ours, theirs := testenv.Name("onceler_amqp_kombu"), testenv.Name("onceler_amqp_kombu")
	cleanupQueue(t, ours, theirs)
	p := newPublisher(t, cfg)
	ctx := ctxTimeout(t, 60*time.Second)
	must(t, p.Declare(ctx, CeleryQueue(ours)), "declare ours first")
	id1 := celerySendTask(t, ours, false) // Celery re-declares: a 406 would fail the script
	id2 := celerySendTask(t, theirs, false)

	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQueue(ours), CeleryQueue(theirs)}})
	got := make(chan *Delivery, 4)
	runConsumer(t, c, func(d *Delivery) { got <- d })
	ids := map[string]bool{}
	for range 2 {
		d := recv(t, got, 15*time.Second)
		h := d.Headers
		tl, _ := h["timelimit"].([]any)
		if h["task"] != "probe.add" || h["id"] != d.CorrelationID || h["lang"] != "py" ||
			intOf(h["retries"]) != 0 || h["eta"] != nil || len(tl) != 2 || tl[0] != nil || tl[1] != nil {
			t.Fatalf("celery headers arrived as %#v", h)
		}
		if d.ContentType != "application/json" || d.ContentEncoding != "utf-8" || d.DeliveryMode != 2 || d.Exchange != "" {
			t.Fatalf("celery properties: %q %q mode %d exchange %q", d.ContentType, d.ContentEncoding, d.DeliveryMode, d.Exchange)
		}
		ids[d.CorrelationID] = true
		must(t, d.Ack(), "ack")
	}
	if !ids[id1] || !ids[id2] {
		t.Fatalf("received task ids %v, want %s and %s", ids, id1, id2)
	}
}

// A quorum queue declared by Celery is consumed with per-consumer prefetch,
// and a requeued message comes back with x-delivery-count.
func TestQuorumQueueDeliveryCount(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t)
	q := testenv.Name("onceler_amqp_quorum")
	cleanupQueue(t, q)
	celerySendTask(t, q, true)
	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQuorumQueue(q)}, Prefetch: 4})
	got := make(chan *Delivery, 4)
	runConsumer(t, c, func(d *Delivery) { got <- d })
	first := recv(t, got, 15*time.Second)
	if first.DeliveryCount != 0 || first.Redelivered {
		t.Fatalf("first delivery: count %d redelivered %t", first.DeliveryCount, first.Redelivered)
	}
	must(t, first.Nack(true), "requeue")
	second := recv(t, got, 10*time.Second)
	if second.DeliveryCount != 1 || !second.Redelivered {
		t.Fatalf("requeued delivery: count %d redelivered %t, headers %v", second.DeliveryCount, second.Redelivered, second.Headers)
	}
	must(t, second.Reject(true), "requeue again")
	third := recv(t, got, 10*time.Second)
	if third.DeliveryCount != 2 {
		t.Fatalf("third delivery count %d, want 2", third.DeliveryCount)
	}
	must(t, third.Ack(), "ack")
	if c.Prefetch() != 4 {
		t.Fatalf("prefetch %d", c.Prefetch())
	}
	must(t, c.SetPrefetch(8), "SetPrefetch on a quorum consumer") // per-consumer QoS, no 406
}

// A queue that exists is served as it is, whatever flags it has; a missing
// queue the broker refuses to declare with the arguments given fails with a
// *PreconditionError that quotes the broker; a passive spec only checks.
func TestPreconditionFailureSaysWhatDiffers(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t)
	q, bad := testenv.Name("onceler_amqp_406"), testenv.Name("onceler_amqp_406_bad")
	cleanupQueue(t, q, bad)
	p := newPublisher(t, cfg)
	ctx := ctxTimeout(t, 30*time.Second)
	// Someone made it non-durable; Celery's spec says durable.
	must(t, p.Declare(ctx, QueueSpec{Name: q, Exchange: DefaultExchange}), "declare transient")
	found, err := p.DeclareQueue(ctx, CeleryQuorumQueue(q))
	must(t, err, "declare an existing transient classic queue as Celery's quorum queue")
	if found.Durable || found.IsQuorum() || found.Args != nil {
		t.Fatalf("found %+v, want the transient classic queue as it is", found)
	}

	// Arguments the broker does not accept for a missing queue.
	spec := CeleryQueue(bad)
	spec.Args = map[string]any{"x-max-priority": "ten"}
	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{spec}})
	err = c.Run(ctx, func(*Delivery) { t.Error("delivery despite a refused declare") })
	var pe *PreconditionError
	if !errors.As(err, &pe) || !errors.Is(err, ErrPrecondition) || !IsTopologyError(err) {
		t.Fatalf("Run = %v, want a *PreconditionError", err)
	}
	if pe.Kind != "queue" || pe.Name != bad || !strings.Contains(pe.Reason, "x-max-priority") {
		t.Fatalf("precondition error fields: %+v", pe)
	}
	for _, want := range []string{bad, "x-max-priority: ten", "PRECONDITION_FAILED", "invalid arg 'x-max-priority'"} {
		if !strings.Contains(err.Error(), want) {
			t.Fatalf("error %q lacks %q", err, want)
		}
	}
	err = p.Declare(ctx, spec)
	if !errors.As(err, &pe) || !IsPermanent(err) {
		t.Fatalf("publisher declare with a bad argument = %v", err)
	}

	// The publisher's own channel survived the refused declares.
	must(t, p.Publish(ctx, "", q, textMessage("still fine"), PublishOptions{Mandatory: true}), "publish after 406")

	// Passive: checks only; a queue that exists with other flags is fine,
	// a missing one is ErrNotFound.
	passive := CeleryQueue(q)
	passive.Exchange, passive.Passive = DefaultExchange, true
	must(t, p.Declare(ctx, passive), "passive declare of an existing queue")
	missing := QueueSpec{Name: testenv.Name("onceler_amqp_missing"), Exchange: DefaultExchange, Passive: true}
	c2 := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{missing}})
	if err := c2.Run(ctx, func(*Delivery) {}); !errors.Is(err, ErrNotFound) {
		t.Fatalf("passive consume of a missing queue = %v, want ErrNotFound", err)
	}
}

func TestQueueSpecDefaults(t *testing.T) {
	t.Parallel()
	q := QueueSpec{Name: "celery"}.resolved()
	if q.Exchange != "celery" || q.ExchangeType != "direct" || q.RoutingKey != "celery" {
		t.Fatalf("kombu defaults not applied: %+v", q)
	}
	q = QueueSpec{Name: "x", Exchange: DefaultExchange, AutoDelete: true, Quorum: true}.resolved()
	if q.Exchange != "" || !q.Durable || q.AutoDelete {
		t.Fatalf("quorum/default exchange: %+v", q)
	}
	spec := QueueSpec{Name: "x", Quorum: true, Args: map[string]any{"x-max-priority": 10}}
	args, err := spec.queueArgs()
	if err != nil || args["x-queue-type"] != "quorum" || args["x-max-priority"] != 10 {
		t.Fatalf("args %v %v", args, err)
	}
	if spec.Args["x-queue-type"] != nil || spec.MaxPriority() != 10 || !spec.IsQuorum() {
		t.Fatalf("spec changed or misread: %+v", spec)
	}
	if c := CeleryQueue("celery"); !c.Durable || c.AutoDelete || c.Exchange != "celery" || c.RoutingKey != "celery" {
		t.Fatalf("CeleryQueue: %+v", c)
	}
}

// Per-consumer prefetch is not retroactive in RabbitMQ: SetPrefetch on a
// quorum consumer restarts its consumers, and deliveries of the replaced
// consumer stay valid.
func TestQuorumSetPrefetchTakesEffect(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t)
	q := testenv.Name("onceler_amqp_qprefetch")
	cleanupQueue(t, q)
	p := newPublisher(t, cfg)
	ctx := ctxTimeout(t, 30*time.Second)
	must(t, p.Declare(ctx, CeleryQuorumQueue(q)), "declare")
	for i := range 6 {
		must(t, p.Publish(ctx, "", q, textMessage(strconv.Itoa(i)), PublishOptions{}), "publish")
	}
	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQuorumQueue(q)}, Prefetch: 1})
	got := make(chan *Delivery, 10)
	runConsumer(t, c, func(d *Delivery) { got <- d })
	held := []*Delivery{recv(t, got, 10*time.Second)}
	noRecv(t, got, 300*time.Millisecond)
	must(t, c.SetPrefetch(3), "grow")
	for range 3 {
		held = append(held, recv(t, got, 5*time.Second))
	}
	noRecv(t, got, 300*time.Millisecond)
	for _, d := range held {
		must(t, d.Ack(), "ack %s", d.Body)
	}
	for range 2 {
		must(t, recv(t, got, 5*time.Second).Ack(), "ack rest")
	}
	testkit.WaitFor(t, "queue empty", 5*time.Second, func() bool { return testkit.QueueDepth(t, testenv.AMQPURL(t), q) == 0 })
}

// Celery's rpc:// client gets the result this package publishes to its
// reply queue: the full round trip with real Celery, through celeryproto.
func TestCeleryRPCResultRoundTrip(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t)
	q := testenv.Name("onceler_amqp_rpc")
	cleanupQueue(t, q)
	py := testenv.Python(t)
	script := `
import sys
from celery import Celery
from kombu import Exchange, Queue
url, name = sys.argv[1], sys.argv[2]
app = Celery("probe", broker=url, backend="rpc://")
app.conf.task_queues = [Queue(name, Exchange(name), routing_key=name)]
r = app.send_task("probe.add", args=(2, 3), queue=name)
print(r.get(timeout=30))
`
	cmd := exec.Command(py, "-c", script, testenv.AMQPURL(t), q)
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	must(t, cmd.Start(), "start python")
	waited := false
	t.Cleanup(func() {
		if !waited {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQueue(q)}})
	got := make(chan *Delivery, 1)
	runConsumer(t, c, func(d *Delivery) { got <- d })
	d := recv(t, got, 30*time.Second)
	msg, err := celeryproto.Decode(&d.Delivery)
	must(t, err, "decode celery task")
	if msg.Task != "probe.add" || len(msg.Args) != 2 || msg.ReplyTo == "" {
		t.Fatalf("decoded %+v", msg)
	}
	sum := int64(0)
	for _, a := range msg.Args {
		sum += a.(int64)
	}
	res, err := celeryproto.EncodeResult(&celeryproto.Result{TaskID: msg.ID, Status: celeryproto.StateSuccess, Value: sum})
	must(t, err, "encode result")
	p := newPublisher(t, cfg)
	ctx := ctxTimeout(t, 30*time.Second)
	must(t, p.Publish(ctx, "", msg.ReplyTo, res, PublishOptions{Mandatory: true}), "publish result")
	must(t, d.Ack(), "ack")
	err = cmd.Wait()
	waited = true
	if err != nil {
		t.Fatalf("celery client: %v\n%s", err, out.String())
	}
	if strings.TrimSpace(out.String()) != "5" {
		t.Fatalf("celery client printed %q, want 5", out.String())
	}
}

// A producer's x-delivery-count header is not taken for the broker's count:
// a classic queue passes it through untouched (RabbitMQ counts deliveries
// only on quorum queues), so it is ignored there, first delivery or not; a
// quorum queue's count is the broker's, whether the spec says Quorum or
// gives x-queue-type in Args.
func TestProducerDeliveryCountNotTrusted(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t)
	classic, quorum, byArgs := testenv.Name("onceler_amqp_dc_classic"), testenv.Name("onceler_amqp_dc_quorum"), testenv.Name("onceler_amqp_dc_args")
	cleanupQueue(t, classic, quorum, byArgs)
	specs := []QueueSpec{CeleryQueue(classic), CeleryQuorumQueue(quorum), CeleryQueue(byArgs)}
	specs[2].Args = map[string]any{"x-queue-type": "quorum"}
	p := newPublisher(t, cfg)
	ctx := ctxTimeout(t, 30*time.Second)
	for _, s := range specs {
		must(t, p.Declare(ctx, s), "declare %s", s.Name)
		msg := textMessage(`"counted?"`)
		msg.Headers = map[string]any{"x-delivery-count": int64(99)}
		must(t, p.Publish(ctx, "", s.Name, msg, PublishOptions{}), "publish to %s", s.Name)
	}
	c := NewConsumer(cfg, ConsumerConfig{Queues: specs, Prefetch: 4})
	got := make(chan *Delivery, 8)
	runConsumer(t, c, func(d *Delivery) { got <- d })
	counts := map[string][]int{}
	for len(counts[classic])+len(counts[quorum])+len(counts[byArgs]) < 6 {
		d := recv(t, got, 15*time.Second)
		counts[d.Queue] = append(counts[d.Queue], d.DeliveryCount)
		if len(counts[d.Queue]) == 1 {
			if d.Redelivered {
				t.Errorf("%s: first delivery marked redelivered", d.Queue)
			}
			must(t, d.Nack(true), "requeue")
			continue
		}
		if !d.Redelivered {
			t.Errorf("%s: requeued delivery not marked redelivered", d.Queue)
		}
		must(t, d.Ack(), "ack")
	}
	want := map[string][]int{classic: {0, 0}, quorum: {0, 1}, byArgs: {0, 1}}
	for q, w := range want {
		if !slices.Equal(counts[q], w) {
			t.Errorf("%s: delivery counts %v, want %v", q, counts[q], w)
		}
	}
}

func TestQueueSpecDeliveryLimit(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		q    QueueSpec
		want int
	}{
		{QueueSpec{Quorum: true, Args: map[string]any{"x-delivery-limit": int32(3)}}, 3},
		{QueueSpec{Args: map[string]any{"x-queue-type": "quorum", "x-delivery-limit": int64(20)}}, 20},
		{QueueSpec{Args: map[string]any{"x-delivery-limit": int32(3)}}, 0}, // a classic queue has none
		{QueueSpec{Quorum: true}, 0},
		{QueueSpec{Quorum: true, Args: map[string]any{"x-delivery-limit": "3"}}, 0},
		{QueueSpec{Quorum: true, Args: map[string]any{"x-delivery-limit": int32(-1)}}, 0},
	} {
		if got := c.q.DeliveryLimit(); got != c.want {
			t.Errorf("%+v: DeliveryLimit %d, want %d", c.q, got, c.want)
		}
	}
}
