package amqp091

import (
	"errors"
	"io"
	"net"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceler/onceler/internal/testkit"
)

// freezeProxy forwards TCP between a client and the broker; once frozen it
// stops passing the broker's bytes to the client (a broker gone silent, its
// socket still open) while the client's still reach the broker.
type freezeProxy struct {
	ln     net.Listener
	target string
	frozen atomic.Bool
	wg     sync.WaitGroup
	mu     sync.Mutex
	conns  []net.Conn
}

func newFreezeProxy(t *testing.T, target string) *freezeProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &freezeProxy{ln: ln, target: target}
	p.wg.Go(p.accept)
	t.Cleanup(func() {
		_ = ln.Close()
		p.mu.Lock()
		for _, c := range p.conns {
			_ = c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	return p
}

func (p *freezeProxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, s)
		p.mu.Unlock()
		p.wg.Go(func() { _, _ = io.Copy(s, c) })
		p.wg.Go(func() {
			buf := make([]byte, 32<<10)
			for {
				n, err := s.Read(buf)
				if n > 0 && !p.frozen.Load() {
					if _, werr := c.Write(buf[:n]); werr != nil {
						return
					}
				}
				if err != nil {
					return
				}
			}
		})
	}
}

func proxiedURL(t *testing.T) (string, *freezeProxy) {
	t.Helper()
	raw := testkit.Rabbit.URL(t)
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	p := newFreezeProxy(t, u.Host)
	u.Host = p.ln.Addr().String()
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
	p.frozen.Store(true)
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
