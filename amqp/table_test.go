package amqp

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"

	amqp091 "github.com/onceler/onceler/internal/amqp091"
	"github.com/onceler/onceler/internal/testenv"
)

func TestFromTableConvertsNestedValues(t *testing.T) {
	t.Parallel()
	in := amqp091.Table{
		"s": "x", "i": int32(3), "u": uint16(4), "b": uint8(5), "n": nil,
		"arr": []any{int64(1), amqp091.Table{"k": uint32(6)}, nil},
		"tbl": amqp091.Table{"inner": amqp091.Table{"deep": "y"}},
		"dec": amqp091.Decimal{Scale: 2, Value: -1234},
	}
	m := fromTable(in)
	if m["s"] != "x" || m["i"] != int32(3) || m["u"] != int64(4) || m["b"] != int64(5) || m["n"] != nil || m["dec"] != "-12.34" {
		t.Fatalf("scalars: %#v", m)
	}
	arr := m["arr"].([]any)
	if arr[0] != int64(1) || arr[1].(map[string]any)["k"] != int64(6) || arr[2] != nil {
		t.Fatalf("array: %#v", arr)
	}
	deep := m["tbl"].(map[string]any)["inner"].(map[string]any)
	if deep["deep"] != "y" {
		t.Fatalf("nested: %#v", m["tbl"])
	}
	if fromTable(nil) != nil {
		t.Fatal("nil table")
	}
	if s := decimalString(amqp091.Decimal{Scale: 3, Value: 5}); s != "0.005" {
		t.Fatalf("decimal %s", s)
	}
}

func TestToTableLeavesCallerMapAlone(t *testing.T) {
	t.Parallel()
	flat := map[string]any{"task": "t", "retries": 1, "eta": nil, "tl": []any{1.5, nil}}
	tb, err := toTable(flat)
	must(t, err, "flat")
	if fmt.Sprintf("%p", tb) != fmt.Sprintf("%p", flat) {
		t.Fatal("flat headers were copied")
	}
	nested := map[string]any{"m": map[string]any{"a": []string{"x"}}, "u": uint64(7), "ints": []int{1, 2}, "sm": map[string]int{"k": 1}}
	tb, err = toTable(nested)
	must(t, err, "nested")
	if _, ok := nested["m"].(map[string]any); !ok {
		t.Fatal("caller map changed")
	}
	must(t, tb.Validate(), "amqp091 validates the converted table")
	if tb["u"] != int64(7) || fmt.Sprint(tb["ints"]) != "[1 2]" || tb["sm"].(amqp091.Table)["k"] != 1 {
		t.Fatalf("converted: %#v", tb)
	}
	if _, err := toTable(map[string]any{"bad": struct{}{}}); err == nil {
		t.Fatal("struct header accepted")
	}
	if _, err := toTable(map[string]any{"big": uint64(1) << 63}); err == nil {
		t.Fatal("overflowing uint64 accepted")
	}
}

// Celery-like protocol-2 headers: the conversion must not allocate for them.
func BenchmarkFromTableCeleryHeaders(b *testing.B) {
	mk := func() amqp091.Table {
		return amqp091.Table{
			"lang": "py", "task": "proj.tasks.add", "id": "d0b1c3a2-0000-4000-8000-000000000000",
			"shadow": nil, "eta": nil, "expires": nil, "group": nil, "group_index": nil,
			"retries": int32(0), "timelimit": []any{nil, nil}, "root_id": "r", "parent_id": nil,
			"argsrepr": "(2, 3)", "kwargsrepr": "{}", "origin": "gen1@host", "ignore_result": false,
		}
	}
	tables := make([]amqp091.Table, b.N)
	for i := range tables {
		tables[i] = mk()
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		_ = fromTable(tables[i])
	}
}

// BenchmarkPublishConfirm measures confirmed publishes per second with many
// concurrent callers sharing the publisher's channel.
func BenchmarkPublishConfirm(b *testing.B) {
	b.Run("mandatory", func(b *testing.B) { benchPublish(b, true) })
	b.Run("plain", func(b *testing.B) { benchPublish(b, false) })
}

func benchPublish(b *testing.B, mandatory bool) {
	cfg := Config{URL: testenv.AMQPURL(b), Name: testenv.Name("onceler_amqp_bench"), Logger: zap.NewNop()}
	q := testenv.Name("onceler_amqp_bench")
	p := NewPublisher(cfg)
	defer p.Close()
	ctx := context.Background()
	spec := QueueSpec{Name: q, Exchange: DefaultExchange, AutoDelete: false, Args: map[string]any{"x-max-length": 50000}}
	if err := p.Declare(ctx, spec); err != nil {
		b.Fatal(err)
	}
	defer func() { _, _ = p.DeleteQueue(ctx, q) }()
	msg := textMessage(`[[1, 2], {}, {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]`)
	msg.Headers = map[string]any{"task": "bench", "id": "x", "retries": 0}
	msg.DeliveryMode = 1
	b.SetParallelism(64)
	b.ResetTimer()
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if err := p.Publish(ctx, "", q, msg, PublishOptions{Mandatory: mandatory}); err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "confirmed/s")
}

// BenchmarkConsumeAck measures deliveries per second, each acknowledged
// from another goroutine (as the worker's pool does).
func BenchmarkConsumeAck(b *testing.B) {
	cfg := Config{URL: testenv.AMQPURL(b), Name: testenv.Name("onceler_amqp_bench"), Logger: zap.NewNop()}
	q := testenv.Name("onceler_amqp_bench")
	p := NewPublisher(cfg)
	defer p.Close()
	ctx := context.Background()
	spec := QueueSpec{Name: q, Exchange: DefaultExchange}
	if err := p.Declare(ctx, spec); err != nil {
		b.Fatal(err)
	}
	defer func() { _, _ = p.DeleteQueue(ctx, q) }()
	msg := textMessage(`[[1, 2], {}, {}]`)
	msg.DeliveryMode = 1
	var wg sync.WaitGroup
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := g; i < b.N; i += 16 {
				if err := p.Publish(ctx, "", q, msg, PublishOptions{}); err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{spec}, Prefetch: 1000})
	work := make(chan *Delivery, 2000)
	var acked atomic.Int64
	done := make(chan struct{})
	var workers sync.WaitGroup
	for range 8 {
		workers.Add(1)
		go func() {
			defer workers.Done()
			for d := range work {
				if err := d.Ack(); err != nil && acked.Load() < int64(b.N) {
					b.Error(err)
				}
				if acked.Add(1) == int64(b.N) {
					close(done)
				}
			}
		}()
	}
	runCtx, cancel := context.WithCancel(ctx)
	runDone := make(chan error, 1)
	b.ResetTimer()
	start := time.Now()
	go func() { runDone <- c.Run(runCtx, func(d *Delivery) { work <- d }) }()
	<-done
	elapsed := time.Since(start)
	cancel()
	<-runDone
	close(work)
	workers.Wait()
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "acked/s")
}
