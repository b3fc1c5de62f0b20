package tasks

import (
	"fmt"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/internal/testkit"
)

// TestETADoesNotStarve: many deliveries held for their ETA do not block
// immediate ones behind them, on a classic queue (global QoS grows with the
// held set) and on a quorum queue (per-consumer QoS, consumers restarted
// under the grown limit).
func TestETADoesNotStarve(t *testing.T) {
	for _, quorum := range []bool{false, true} {
		t.Run(fmt.Sprintf("quorum=%v", quorum), func(t *testing.T) {
			e := newEnv(t)
			cfg := e.config()
			cfg.Concurrency, cfg.Prefetch = 2, 4
			if quorum {
				q := e.quorumQueue()
				e.queue = q
				cfg.Queues = []amqp.QueueSpec{{Name: q, Exchange: amqp.DefaultExchange, Durable: true, Quorum: true}}
			}
			fx := &effects{}
			r := e.start(testRegistry(t, fx), cfg)
			replyTo, replies := e.replyQueue()
			const held, quick = 40, 10
			// Far enough ahead that the holds, the prefetch's growth and
			// the immediate tasks fit before it on a slow, busy machine.
			due := time.Now().Add(12 * time.Second)
			for i := range held {
				m := payMessage("t.pay", i, fmt.Sprintf("eta-%d", i), replyTo)
				m.ETA = due
				e.publish(m)
			}
			testkit.WaitFor(t, "ETA deliveries held", 10*time.Second, func() bool { return len(r.w.Scheduled()) == held })
			testkit.WaitFor(t, "prefetch grown by the held set", 5*time.Second, func() bool { return consumerOf(r.w).Prefetch() == cfg.Prefetch+held })
			sent := time.Now()
			for i := range quick {
				e.publish(payMessage("t.pay", held+i, fmt.Sprintf("now-%d", i), replyTo))
			}
			got := results(t, replies, quick, 10*time.Second)
			took := time.Since(sent)
			for i := range quick {
				if len(got[taskID(held+i)]) != 1 {
					t.Fatalf("immediate tasks answered: %v", got)
				}
			}
			if !time.Now().Before(due) {
				t.Errorf("immediate tasks answered only after the ETAs were due (%s)", took)
			}
			t.Logf("%d immediate tasks answered in %s behind %d held ETA deliveries (prefetch %d)", quick, took, held, consumerOf(r.w).Prefetch())
			got = results(t, replies, held, 20*time.Second)
			t.Logf("held tasks answered %s after due", time.Since(due))
			if len(got) != held || time.Now().Before(due) {
				t.Errorf("ETA tasks: %d answered, at %s before due", len(got), time.Until(due))
			}
			checkExactlyOnce(t, fx, held+quick, func(i int) string {
				if i < held {
					return fmt.Sprintf("eta-%d", i)
				}
				return fmt.Sprintf("now-%d", i-held)
			})
		})
	}
}

// TestETAHeldThroughChannelClose: deliveries held for their ETA when the
// broker closes the consumer's connection (as it does at its
// consumer_timeout) are not lost: the broker redelivers them, the stale
// copies are dropped (the prefetch window shrinks back), and each runs once
// when due.
func TestETAHeldThroughChannelClose(t *testing.T) {
	e := newEnv(t)
	cfg := e.config()
	cfg.Concurrency, cfg.Prefetch = 2, 4
	fx := &effects{}
	r := e.start(testRegistry(t, fx), cfg)
	replyTo, replies := e.replyQueue()
	const held = 6
	// Due late enough that the connection is closed while they are still
	// held: finding it (rabbitmqctl) takes seconds on a loaded machine.
	due := time.Now().Add(20 * time.Second)
	for i := range held {
		m := payMessage("t.pay", i, fmt.Sprintf("eta-%d", i), replyTo)
		m.ETA = due
		e.publish(m)
	}
	testkit.WaitFor(t, "ETA deliveries held", 10*time.Second, func() bool { return len(r.w.Scheduled()) == held })
	pids := testkit.ConnectionPIDs(t, cfg.Broker.Name+" consume")
	if len(pids) == 0 {
		t.Fatal("consumer connection not found")
	}
	testkit.CloseConnections(t, pids)
	testkit.WaitFor(t, "held copies replaced by redeliveries after the reconnect", 15*time.Second, func() bool {
		s := r.w.Scheduled()
		for _, ti := range s {
			if !ti.Redelivered {
				return false
			}
		}
		return len(s) == held && consumerOf(r.w).Prefetch() == cfg.Prefetch+held
	})
	if time.Now().After(due) {
		t.Fatal("the held copies were replaced only after they were due: the test did not close the connection in time")
	}
	got := results(t, replies, held, 40*time.Second)
	if time.Now().Before(due) {
		t.Errorf("ETA tasks answered %s before due", time.Until(due))
	}
	for i := range held {
		if len(got[taskID(i)]) != 1 || got[taskID(i)][0]["status"] != "SUCCESS" {
			t.Errorf("task %d: %v", i, got[taskID(i)])
		}
	}
	checkExactlyOnce(t, fx, held, func(i int) string { return fmt.Sprintf("eta-%d", i) })
	testkit.WaitFor(t, "queue empty and prefetch back", 10*time.Second, func() bool {
		return e.queueDepth(e.queue) == 0 && consumerOf(r.w).Prefetch() == cfg.Prefetch
	})
}

// TestLongETARepublished: a delivery due after Config.MaxHold is republished
// and acknowledged at each MaxHold instead of being held past the broker's
// consumer_timeout; it runs once, when due, and the consumer's channel is
// never closed.
func TestLongETARepublished(t *testing.T) {
	e := newEnv(t)
	core, logs := observer.New(zapcore.DebugLevel)
	cfg := e.config()
	cfg.MaxHold = 700 * time.Millisecond
	// A window the memory budget does not cap (the default, 256 deliveries
	// of up to 16 MiB, is capped at what 2 GiB holds): the window in force
	// is then the configured one.
	cfg.Concurrency, cfg.Prefetch = 8, 32
	cfg.Logger = zap.New(zapcore.NewTee(cfg.Logger.Core(), core))
	cfg.Broker.Logger = zap.New(zapcore.NewTee(cfg.Broker.Logger.Core(), core))
	fx := &effects{}
	r := e.start(testRegistry(t, fx), cfg)
	replyTo, replies := e.replyQueue()
	m := payMessage("t.pay", 1, "long-eta", replyTo)
	due := time.Now().Add(3 * time.Second)
	m.ETA = due
	e.publish(m)
	got := results(t, replies, 1, 10*time.Second)
	if time.Now().Before(due) || len(got[m.ID]) != 1 || got[m.ID][0]["status"] != "SUCCESS" {
		t.Errorf("long ETA task: %v, %s before due", got, time.Until(due))
	}
	if n := logs.FilterMessageSnippet("held delivery republished").Len(); n < 3 {
		t.Errorf("republished %d times, want at least 3 (every 700 ms for 3 s)", n)
	}
	if n := logs.FilterMessageSnippet("reconnecting").Len() + logs.FilterMessageSnippet("lost with their channel").Len(); n != 0 {
		t.Errorf("consumer channel lost %d times", n)
	}
	checkExactlyOnce(t, fx, 1, func(int) string { return "long-eta" })
	testkit.WaitFor(t, "queue empty and prefetch back", 10*time.Second, func() bool {
		return e.queueDepth(e.queue) == 0 && consumerOf(r.w).Prefetch() == r.w.cfg.Prefetch
	})
}
