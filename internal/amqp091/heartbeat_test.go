package amqp091

import (
	"errors"
	"net"
	"net/url"
	"testing"
	"time"

	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// proxiedURL is the broker's URL through a proxy the test can freeze.
func proxiedURL(t *testing.T) (string, *testenv.CutProxy) {
	t.Helper()
	raw := testkit.Rabbit.URL(t)
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	p := testenv.NewCutProxy(t, u.Host)
	u.Host = p.Addr()
	return u.String(), p
}

// An idle connection stays open: with nothing else to send, the client
// sends heartbeats often enough that the broker does not give it up (the
// last send is read by the heartbeater from the time each flush stored).
func TestHeartbeatsKeepIdleConnection(t *testing.T) {
	u, _ := proxiedURL(t)
	conn, err := DialConfig(u, Config{Heartbeat: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	closed := conn.NotifyClose(make(chan *Error, 1))
	// RabbitMQ closes a connection after two missed heartbeat intervals.
	select {
	case e := <-closed:
		t.Fatalf("idle connection closed: %v", e)
	case <-time.After(4 * time.Second):
	}
	ch, err := conn.Channel()
	if err != nil {
		t.Fatalf("channel on the idle connection: %v", err)
	}
	_ = ch.Close()
}

// A broker that goes silent (no frame, not even a heartbeat) is given up
// within about three heartbeat intervals, even right after the connection
// was busy: the reader keeps its read deadline ahead of the frames.
func TestSilentBrokerGivenUp(t *testing.T) {
	u, p := proxiedURL(t)
	conn, err := DialConfig(u, Config{Heartbeat: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	closed := conn.NotifyClose(make(chan *Error, 1))
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	// Some traffic, so that the reader has moved its deadline.
	for range 50 {
		if _, err := ch.QueueDeclare("", false, true, true, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	p.Freeze()
	start := time.Now()
	select {
	case e := <-closed:
		took := time.Since(start)
		// Three intervals of a second (the heartbeat halved), less at most
		// a quarter of one for the reader's throttle.
		if took < 2*time.Second || took > 5*time.Second {
			t.Fatalf("silent broker given up after %v, want about 3 s", took)
		}
		if e == nil {
			t.Fatal("closed without an error")
		}
		var nerr net.Error
		if !errors.As(e, &nerr) && e.Code != FrameError {
			t.Logf("closed with %v", e)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("silent broker not given up after 10 s")
	}
}
