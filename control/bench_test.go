package control_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	amqp091 "github.com/onceler/onceler/internal/amqp091"
	"go.uber.org/zap"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/control"
	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
	"github.com/onceler/onceler/tasks"
)

// BenchmarkWorkerEvents measures the real tasks.Worker draining b.N
// pre-published tasks with events off (no remote control) and on (its
// remote control with task events on, its events routed to a celeryev
// queue as Flower binds one). Run it with a fixed count, e.g.
//
//	go test -run '^$' -bench WorkerEvents -benchtime 20000x ./control/
func BenchmarkWorkerEvents(b *testing.B) {
	for _, task := range []string{demo.TaskAdd, demo.TaskCredit} {
		for _, events := range []bool{false, true} {
			b.Run(fmt.Sprintf("%s/events=%v", task, events), func(b *testing.B) {
				w := newBenchWorker(b, task, events, b.N)
				b.ResetTimer()
				cpu0 := testkit.CPUTime()
				elapsed := w.run(b)
				cpu := testkit.CPUTime() - cpu0
				b.StopTimer()
				b.ReportMetric(float64(b.N)/elapsed.Seconds(), "tasks/s")
				b.ReportMetric(float64(cpu.Microseconds())/float64(b.N), "cpu-µs/task")
				w.report(b)
			})
		}
	}
}

// BenchmarkWorkerEventsAB runs two workers at the same time on the same
// machine, one with events off and one with events on, each draining b.N
// tasks of its own queue, so that the load of the machine weighs on both
// alike; it reports each one's throughput and their ratio (on / off).
func BenchmarkWorkerEventsAB(b *testing.B) {
	off := newBenchWorker(b, demo.TaskAdd, false, b.N)
	on := newBenchWorker(b, demo.TaskAdd, true, b.N)
	b.ResetTimer()
	var wg sync.WaitGroup
	var tOff, tOn time.Duration
	wg.Add(2)
	go func() { defer wg.Done(); tOff = off.run(b) }()
	go func() { defer wg.Done(); tOn = on.run(b) }()
	wg.Wait()
	b.StopTimer()
	b.ReportMetric(float64(b.N)/tOff.Seconds(), "off-tasks/s")
	b.ReportMetric(float64(b.N)/tOn.Seconds(), "on-tasks/s")
	b.ReportMetric(tOff.Seconds()/tOn.Seconds(), "on/off")
	on.report(b)
}

type benchWorker struct {
	events    bool
	n         int
	node, evq string
	ch        *amqp091.Channel
	ctl       *control.Controller
	w         *tasks.Worker
}

// newBenchWorker makes a worker (with events, with its remote control) for a
// queue holding n tasks named task; everything is removed when b ends.
func newBenchWorker(b *testing.B, task string, events bool, n int) *benchWorker {
	b.Helper()
	url := testenv.AMQPURL(b)
	pool := testenv.Pool(b)
	schema := testenv.Schema(b, pool)
	ctx := context.Background()
	store, err := idempotency.New(pool, idempotency.Config{Schema: schema})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(store.Close)
	if err := store.Migrate(ctx); err != nil {
		b.Fatal(err)
	}
	if err := demo.Migrate(ctx, pool); err != nil {
		b.Fatal(err)
	}
	reg := tasks.NewRegistry()
	if err := demo.Register(reg, pool); err != nil {
		b.Fatal(err)
	}
	suffix := strings.TrimPrefix(testenv.Name("t"), "t_")
	queue := "onceler_ctl_bench_" + suffix
	bw := &benchWorker{events: events, n: n, node: "onceler-bench-" + suffix + "@h"}

	conn, err := amqp091.Dial(url)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		b.Fatal(err)
	}
	bw.ch = ch
	if err := ch.ExchangeDeclare(queue, "direct", true, false, false, false, nil); err != nil {
		b.Fatal(err)
	}
	if _, err := ch.QueueDeclare(queue, true, false, false, false, nil); err != nil {
		b.Fatal(err)
	}
	if err := ch.QueueBind(queue, queue, queue, false, nil); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		_, _ = ch.QueueDelete(queue, false, false, false)
		_, _ = ch.QueueDelete(queue+".quarantine", false, false, false)
		_ = ch.ExchangeDelete(queue, false, false)
	})
	for i := range n {
		m := &celeryproto.Message{Task: task, ID: fmt.Sprintf("%s-%d", suffix, i), Args: []any{}, Kwargs: map[string]any{"x": int64(i), "y": int64(1)}}
		if task == demo.TaskCredit {
			m.Kwargs = map[string]any{"account": "bench-" + suffix, "entry_id": m.ID, "cents": int64(1)}
		}
		p, err := celeryproto.EncodeTask(m, celeryproto.EncodeOptions{})
		if err != nil {
			b.Fatal(err)
		}
		if err := ch.PublishWithContext(ctx, "", queue, false, false, control.Publishing(p)); err != nil {
			b.Fatal(err)
		}
	}
	for {
		q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		if err != nil {
			b.Fatal(err)
		}
		if q.Messages >= n {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	// a celeryev queue, as Flower binds one; read after the measurement so
	// that the listener's CPU is not counted as the worker's
	evq, err := ch.QueueDeclare("", false, true, true, false, nil)
	if err != nil {
		b.Fatal(err)
	}
	if err := ch.QueueBind(evq.Name, "task.#", control.EventExchange, false, nil); err != nil {
		b.Fatal(err)
	}
	bw.evq = evq.Name

	cfg := tasks.Config{
		Broker: amqp.Config{URL: url, Name: "onceler bench " + bw.node}, Queues: []amqp.QueueSpec{amqp.CeleryQueue(queue)},
		Store: store, Pool: pool, Hostname: bw.node, Logger: zap.NewNop(),
		NoControl: !events, TaskEvents: events,
	}
	if bw.w, err = tasks.NewWorker(reg, cfg); err != nil {
		b.Fatal(err)
	}
	bw.ctl = bw.w.Controller()
	return bw
}

// run starts the worker (with its remote control), waits until it has
// processed all n tasks, stops it and returns how long that took.
func (bw *benchWorker) run(b *testing.B) time.Duration {
	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	start := time.Now()
	wg.Add(1)
	go func() { defer wg.Done(); _ = bw.w.Run(ctx) }()
	for control.Processed(bw.w.Stats()) < int64(bw.n) {
		time.Sleep(5 * time.Millisecond)
	}
	elapsed := time.Since(start)
	stop()
	wg.Wait()
	return elapsed
}

// report adds the event counters of an events-on worker.
func (bw *benchWorker) report(b *testing.B) {
	if bw.ctl == nil {
		return
	}
	sent, dropped, _ := bw.ctl.Counters()
	b.ReportMetric(float64(sent), "events-sent")
	b.ReportMetric(float64(dropped), "events-dropped")
	b.ReportMetric(float64(countEvents(b, bw.ch, bw.evq, bw.node)), "events-received")
}

// countEvents reads the events of node queued in q.
func countEvents(b *testing.B, ch *amqp091.Channel, q, node string) int {
	n := 0
	for {
		d, ok, err := ch.Get(q, true)
		if err != nil {
			b.Fatal(err)
		}
		if !ok {
			return n
		}
		if d.Headers["hostname"] == node {
			n += strings.Count(string(d.Body), `"type":`)
		}
	}
}
