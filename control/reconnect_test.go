package control

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/onceler/onceler/internal/amqp091"

	"github.com/onceler/onceler/internal/testkit"
)

// closeConnection closes, from the broker side, the connection this test's
// controller opened (by its unique name).
func closeConnection(t *testing.T, name string) {
	t.Helper()
	if !strings.HasPrefix(name, "onceler_control_test_") {
		t.Fatalf("refusing to close a connection not named by this test: %q", name)
	}
	pids := testkit.ConnectionPIDs(t, name)
	if len(pids) != 1 {
		t.Fatalf("found %d connections named %s, want 1", len(pids), name)
	}
	testkit.CloseConnections(t, pids)
}

type rawEvent struct {
	fields map[string]any
	d      amqp091.Delivery
}

// watchWorkerEvents consumes worker.# from celeryev for node.
func watchWorkerEvents(t *testing.T, url, node string) <-chan rawEvent {
	t.Helper()
	conn, err := amqp091.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	q, err := ch.QueueDeclare("", false, true, true, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.ExchangeDeclare(EventExchange, "topic", true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := ch.QueueBind(q.Name, "worker.#", EventExchange, false, nil); err != nil {
		t.Fatal(err)
	}
	ds, err := ch.Consume(q.Name, "", true, true, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	out := make(chan rawEvent, 100)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for d := range ds {
			if d.Headers["hostname"] != node {
				continue
			}
			var f map[string]any
			if err := json.Unmarshal(d.Body, &f); err != nil {
				t.Errorf("event body %q: %v", d.Body, err)
				continue
			}
			select {
			case out <- rawEvent{f, d}:
			default:
				t.Error("event watcher overflow")
			}
		}
	}()
	t.Cleanup(func() { _ = conn.Close(); <-done })
	return out
}

func nextEvent(t *testing.T, evs <-chan rawEvent, within time.Duration) rawEvent {
	t.Helper()
	select {
	case ev := <-evs:
		return ev
	case <-time.After(within):
		t.Fatalf("no worker event within %v", within)
		return rawEvent{}
	}
}

func TestWorkerEventsAndReconnect(t *testing.T) {
	n := newNode(t, false)
	evs := watchWorkerEvents(t, n.url, n.name)
	n.start(t)

	online := nextEvent(t, evs, 5*time.Second)
	if online.fields["type"] != "worker-online" || online.d.RoutingKey != "worker.online" || online.d.DeliveryMode != 1 ||
		online.d.ContentType != "application/json" || online.fields["freq"] != 2.0 || online.fields["sw_ident"] != "onceler" {
		t.Fatalf("first event = %v (%s)", online.fields, online.d.RoutingKey)
	}
	start := time.Now()
	hb := nextEvent(t, evs, 5*time.Second)
	if hb.fields["type"] != "worker-heartbeat" || hb.d.RoutingKey != "worker.heartbeat" {
		t.Fatalf("second event = %v", hb.fields)
	}
	if el := time.Since(start); el < time.Second || el > 3*time.Second {
		t.Errorf("heartbeat after %v, want about 2s", el)
	}
	if hb.fields["clock"].(float64) <= online.fields["clock"].(float64) {
		t.Errorf("clock did not advance: %v then %v", online.fields["clock"], hb.fields["clock"])
	}

	closeConnection(t, n.ctl.cfg.ConnectionName)
	deadline := time.Now().Add(10 * time.Second)
	for n.ctl.sessions.Load() < 2 {
		if time.Now().After(deadline) {
			t.Fatal("controller did not reconnect")
		}
		time.Sleep(10 * time.Millisecond)
	}
	// a heartbeat at once after the reconnect, and heartbeats go on
	for range 2 {
		if ev := nextEvent(t, evs, 5*time.Second); ev.fields["type"] != "worker-heartbeat" {
			t.Fatalf("after reconnect: %v", ev.fields)
		}
	}
	if got := n.inspect(t, "ping"); !jsonEqual(got, map[string]any{"ok": "pong"}) {
		t.Errorf("ping after reconnect = %v", got)
	}

	n.stop()
	for {
		ev := nextEvent(t, evs, 5*time.Second)
		if ev.fields["type"] == "worker-offline" {
			break
		}
		if ev.fields["type"] != "worker-heartbeat" {
			t.Fatalf("unexpected event %v", ev.fields)
		}
	}
}
