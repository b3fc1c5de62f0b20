package demo

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"go.uber.org/zap/zaptest"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/workerhooks"
	"github.com/onceler/onceler/tasks"
)

// TestNoRecordWorkerRunsSameDBTasks: the demo tasks run under a worker
// without the record (workerhooks NoRecord): each copy of a
// ledger credit commits its own entry, as a run without the record shows.
func TestNoRecordWorkerRunsSameDBTasks(t *testing.T) {
	d := newDemo(t)
	url := testenv.AMQPURL(t)
	queue := testenv.Name("demo-nr")
	reg := tasks.NewRegistry()
	if err := Register(reg, d.pool, WithLogger(d.log)); err != nil {
		t.Fatal(err)
	}
	cfg := tasks.Config{
		Broker:   amqp.Config{URL: url, Name: testenv.Name("demo-worker"), Logger: zaptest.NewLogger(t)},
		Queues:   []amqp.QueueSpec{{Name: queue, Durable: true}},
		Pool:     d.pool,
		Grace:    5 * time.Second,
		Hostname: testenv.Name("node"),
		Logger:   zaptest.NewLogger(t),
	}
	workerhooks.Set(&cfg, workerhooks.Hooks{NoRecord: true})
	w, err := tasks.NewWorker(reg, cfg)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := amqp091.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(queue, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_, _ = ch.QueueDelete(queue, false, false, false)
		_, _ = ch.QueueDelete(queue+".quarantine", false, false, false)
	}()
	reply, err := ch.QueueDeclare(testenv.Name("demo-reply"), false, true, true, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	replies, err := ch.Consume(reply.Name, "", true, true, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	entry, account := testenv.Name("e"), testenv.Name("acct")
	for i := range 2 {
		id := fmt.Sprintf("00000000-0000-4000-8000-%012d", i)
		p, err := celeryproto.EncodeTask(&celeryproto.Message{Protocol: 2, Task: TaskCredit, ID: id, ReplyTo: reply.Name,
			CorrelationID: id, Kwargs: map[string]any{"account": account, "entry_id": entry, "cents": int64(7)}},
			celeryproto.EncodeOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if err := ch.PublishWithContext(ctx, "", queue, false, false, amqp091.Publishing{ContentType: p.ContentType,
			ContentEncoding: p.ContentEncoding, Headers: amqp091.Table(p.Headers), Body: p.Body,
			CorrelationId: p.CorrelationID, ReplyTo: p.ReplyTo, DeliveryMode: 2}); err != nil {
			t.Fatal(err)
		}
	}
	for range 2 {
		select {
		case m := <-replies:
			var r map[string]any
			if err := json.Unmarshal(m.Body, &r); err != nil || r["status"] != "SUCCESS" {
				t.Fatalf("reply %s (%v), want SUCCESS", m.Body, err)
			}
		case <-time.After(20 * time.Second):
			t.Fatal("no reply within 20 s")
		}
	}
	n, err := CountLedger(context.Background(), d.pool, entry)
	if err != nil || n != 2 {
		t.Fatalf("ledger rows %d (%v), want 2: one per copy without the record", n, err)
	}
}
