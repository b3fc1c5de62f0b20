package amqp

import (
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/onceler/onceler/internal/testkit"
)

// A loss that repeats as soon as consuming starts (here a message whose
// handling closes the channel, every time it is delivered) makes the
// reconnect backoff grow instead of hammering the broker; a session that
// then stays up resets it.
func TestReconnectBackoffGrowsWhenTheLossRepeats(t *testing.T) {
	cfg, q, p, ctx := declaredQueue(t, "onceler_amqp_backoff", 60*time.Second)
	core, logs := observer.New(zapcore.WarnLevel)
	cfg.Logger = zap.New(zapcore.NewTee(zaptest.NewLogger(t).Core(), core))
	cfg.MinBackoff, cfg.MaxBackoff = 20*time.Millisecond, time.Second

	var poison atomic.Bool
	poison.Store(true)
	var deliveries atomic.Int64
	acked := make(chan struct{}, 1)
	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQueue(q)}})
	runConsumer(t, c, func(d *Delivery) {
		deliveries.Add(1)
		if poison.Load() {
			_ = d.ch.ch.Close() // the channel is lost with the message unsettled
			return
		}
		must(t, d.Ack(), "ack")
		acked <- struct{}{}
	})
	testkit.WaitFor(t, "consumer ready", 10*time.Second, c.Ready)
	must(t, p.Publish(ctx, "", q, textMessage(`"poison"`), PublishOptions{}), "publish")

	// Waits of 10-20 ms, then 20-40, 40-80 ... up to 0.5-1 s: at most
	// about 9 losses in 3 s. Reset after every session that consumed, the
	// waits would stay at 10-20 ms: dozens of losses.
	time.Sleep(3 * time.Second)
	n := c.reconnects.Load()
	if n < 3 || n > 12 {
		t.Fatalf("%d reconnects in 3s (%d deliveries of the message), want 3..12: the backoff does not grow", n, deliveries.Load())
	}

	poison.Store(false)
	select {
	case <-acked:
	case <-time.After(5 * time.Second):
		t.Fatal("the message was not delivered again after the losses")
	}
	// A session that consumed for MaxBackoff resets the backoff.
	time.Sleep(cfg.MaxBackoff + 200*time.Millisecond)
	before := c.reconnects.Load()
	if closeConnection(t, cfg.Name+" consume") != 1 {
		t.Fatal("consumer connection not found")
	}
	testkit.WaitFor(t, "reconnect", 10*time.Second, func() bool { return c.reconnects.Load() > before && c.Ready() })
	last := logs.FilterMessage("consumer disconnected; reconnecting").All()
	fields := last[len(last)-1].ContextMap()
	if fields["failures_in_a_row"] != int64(1) || fields["backoff"].(time.Duration) > cfg.MinBackoff {
		t.Fatalf("after a healthy session: %v, want the first failure and a backoff of at most %v", fields, cfg.MinBackoff)
	}
}
