package control

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"go.uber.org/zap"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/tasks"
)

// BenchmarkWorkerEvents measures the real tasks.Worker draining b.N
// pre-published tasks with task events off and on (published through a
// Controller, and consumed by a celeryev listener as Flower would). Run it
// with a fixed count, e.g.
//
//	go test -run '^$' -bench WorkerEvents -benchtime 20000x ./control/
func BenchmarkWorkerEvents(b *testing.B) {
	for _, task := range []string{demo.TaskAdd, demo.TaskCredit} {
		for _, events := range []bool{false, true} {
			b.Run(fmt.Sprintf("%s/events=%v", task, events), func(b *testing.B) { benchWorker(b, task, events) })
		}
	}
}

func benchWorker(b *testing.B, task string, events bool) {
	url := testenv.AMQPURL(b)
	pool := testenv.Pool(b)
	schema := testenv.Schema(b, pool)
	ctx := context.Background()
	store, err := idempotency.New(pool, idempotency.Config{Schema: schema})
	if err != nil {
		b.Fatal(err)
	}
	defer store.Close()
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
	node := "onceler-bench-" + suffix + "@h"

	conn, err := amqp091.Dial(url)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		b.Fatal(err)
	}
	spec := amqp.CeleryQueue(queue)
	if err := ch.ExchangeDeclare(queue, "direct", true, false, false, false, nil); err != nil {
		b.Fatal(err)
	}
	if _, err := ch.QueueDeclare(queue, true, false, false, false, nil); err != nil {
		b.Fatal(err)
	}
	if err := ch.QueueBind(queue, queue, queue, false, nil); err != nil {
		b.Fatal(err)
	}
	defer func() {
		_, _ = ch.QueueDelete(queue, false, false, false)
		_, _ = ch.QueueDelete(queue+".quarantine", false, false, false)
		_ = ch.ExchangeDelete(queue, false, false)
	}()
	for i := range b.N {
		m := &celeryproto.Message{Task: task, ID: fmt.Sprintf("%s-%d", suffix, i), Args: []any{}, Kwargs: map[string]any{"x": int64(i), "y": int64(1)}}
		if task == demo.TaskCredit {
			m.Kwargs = map[string]any{"account": "bench-" + suffix, "entry_id": m.ID, "cents": int64(1)}
		}
		p, err := celeryproto.EncodeTask(m, celeryproto.EncodeOptions{})
		if err != nil {
			b.Fatal(err)
		}
		if err := ch.PublishWithContext(ctx, "", queue, false, false, publishing(p)); err != nil {
			b.Fatal(err)
		}
	}
	for {
		q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		if err != nil {
			b.Fatal(err)
		}
		if q.Messages >= b.N {
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
	if err := ch.QueueBind(evq.Name, "task.#", EventExchange, false, nil); err != nil {
		b.Fatal(err)
	}

	ctl, err := New(nil, Config{URL: url, NodeName: node, TaskEvents: events, Logger: zap.NewNop()})
	if err != nil {
		b.Fatal(err)
	}
	cfg := tasks.Config{
		Broker: amqp.Config{URL: url, Name: "onceler bench " + node}, Queues: []amqp.QueueSpec{spec},
		Store: store, Pool: pool, Hostname: node, Logger: zap.NewNop(),
	}
	if events {
		cfg.Observer = ctl
	}
	w, err := tasks.NewWorker(reg, cfg)
	if err != nil {
		b.Fatal(err)
	}
	ctl.SetWorker(FromTasks(w))
	runCtx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(2)
	b.ResetTimer()
	cpu0 := cpuTime()
	start := time.Now()
	go func() { defer wg.Done(); _ = ctl.Run(runCtx) }()
	go func() { defer wg.Done(); _ = w.Run(runCtx) }()
	for processed(w.Stats()) < int64(b.N) {
		time.Sleep(5 * time.Millisecond)
	}
	elapsed := time.Since(start)
	cpu := cpuTime() - cpu0
	b.StopTimer()
	stop()
	wg.Wait()
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "tasks/s")
	b.ReportMetric(float64(cpu.Microseconds())/float64(b.N), "cpu-µs/task")
	if events {
		sent, dropped, _ := ctl.Counters()
		b.ReportMetric(float64(sent), "events-sent")
		b.ReportMetric(float64(dropped), "events-dropped")
		b.ReportMetric(float64(countEvents(b, ch, evq.Name, node)), "events-received")
	}
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

// cpuTime is the process's user+system CPU time.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
