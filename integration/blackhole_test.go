package integration

import (
	"net"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/integration/replay"
)

// blackhole is a TCP proxy that can stop passing bytes, both ways, on every
// connection (established and new) while the sockets stay open: what a
// worker sees when the network between it and a service silently drops
// everything. Bytes held during the black hole are passed on after it, if
// the connection is still open by then.
type blackhole struct {
	ln     net.Listener
	target string
	on     atomic.Bool
	quit   chan struct{}
	wg     sync.WaitGroup
	mu     sync.Mutex
	conns  map[net.Conn]struct{}
}

func newBlackhole(t *testing.T, target string) *blackhole {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	b := &blackhole{ln: ln, target: target, quit: make(chan struct{}), conns: make(map[net.Conn]struct{})}
	b.wg.Add(1)
	go b.accept()
	t.Cleanup(b.close)
	return b
}

func (b *blackhole) addr() string { return b.ln.Addr().String() }

func (b *blackhole) accept() {
	defer b.wg.Done()
	for {
		c, err := b.ln.Accept()
		if err != nil {
			return
		}
		b.wg.Add(1)
		go b.serve(c)
	}
}

func (b *blackhole) track(c net.Conn) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	select {
	case <-b.quit:
		_ = c.Close()
		return false
	default:
	}
	b.conns[c] = struct{}{}
	return true
}

func (b *blackhole) serve(c net.Conn) {
	defer b.wg.Done()
	if !b.track(c) || !b.pass() {
		_ = c.Close()
		return
	}
	up, err := net.DialTimeout("tcp", b.target, 10*time.Second)
	if err != nil || !b.track(up) {
		_ = c.Close()
		return
	}
	var wg sync.WaitGroup
	wg.Add(2)
	pipe := func(dst, src net.Conn) {
		defer wg.Done()
		buf := make([]byte, 32<<10)
		for {
			n, err := src.Read(buf)
			if n > 0 {
				if !b.pass() {
					break
				}
				if _, werr := dst.Write(buf[:n]); werr != nil {
					break
				}
			}
			if err != nil {
				break
			}
		}
		_ = dst.Close()
		_ = src.Close()
	}
	go pipe(up, c)
	go pipe(c, up)
	wg.Wait()
	b.mu.Lock()
	delete(b.conns, c)
	delete(b.conns, up)
	b.mu.Unlock()
}

// pass waits while the black hole is on; false when the proxy closes.
func (b *blackhole) pass() bool {
	for b.on.Load() {
		select {
		case <-b.quit:
			return false
		case <-time.After(20 * time.Millisecond):
		}
	}
	select {
	case <-b.quit:
		return false
	default:
		return true
	}
}

func (b *blackhole) close() {
	b.mu.Lock()
	select {
	case <-b.quit:
	default:
		close(b.quit)
	}
	for c := range b.conns {
		_ = c.Close()
	}
	b.mu.Unlock()
	_ = b.ln.Close()
	b.wg.Wait()
}

// via returns rawURL with its host and port replaced by addr.
func via(t *testing.T, rawURL, addr string) string {
	t.Helper()
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatal(err)
	}
	u.Host = addr
	return u.String()
}

func hostPort(t *testing.T, rawURL, defPort string) string {
	t.Helper()
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatal(err)
	}
	if u.Port() == "" {
		return net.JoinHostPort(u.Hostname(), defPort)
	}
	return u.Host
}

// TestBlackhole puts a proxy between the workers and RabbitMQ or
// PostgreSQL, then swallows everything for 12 s in the middle of a stream
// (heartbeats 2 s): the broker side detects the dead connection and
// redelivers; the workers reconnect once the network is back; every caller
// is answered, nothing lost, nothing done twice beyond the policy.
func TestBlackhole(t *testing.T) {
	for _, service := range []string{"rabbitmq", "postgres"} {
		t.Run(service, func(t *testing.T) {
			e := ownEnv(t, "ONCELER_HEARTBEAT=2s")
			var ws []*replay.Worker
			var hole *blackhole
			for range 2 {
				var o replay.WorkerOptions
				if service == "rabbitmq" {
					if hole == nil {
						hole = newBlackhole(t, hostPort(t, e.AMQPURL, "5672"))
					}
					o.BrokerURL = via(t, e.AMQPURL, hole.addr())
				} else {
					if hole == nil {
						hole = newBlackhole(t, hostPort(t, e.DatabaseURL, "5432"))
					}
					o.DatabaseURL = via(t, e.DatabaseURL, hole.addr())
				}
				ws = append(ws, e.StartWorker(o))
			}
			wl := newWorkload(e)
			const n = 200
			for i := range n {
				task := []string{demo.TaskCredit, demo.TaskCharge, demo.TaskCredit, "replay.notify"}[i%4]
				wl.send(task, opName("hole"+service, i))
			}
			replay.Eventually(time.Minute, func() bool { return wl.answered() >= n/5 })
			hole.on.Store(true)
			at := wl.answered()
			time.Sleep(12 * time.Second)
			during := wl.answered() - at
			hole.on.Store(false)
			if !wl.wait(3 * time.Minute) {
				t.Errorf("%d of %d answered after the black hole", wl.answered(), n)
			}
			e.StopAll()
			tl := wl.check(t)
			detected := 0
			for _, w := range ws {
				if strings.Contains(w.Log(), "reconnecting") || strings.Contains(w.Log(), "record unavailable") {
					detected++
				}
			}
			t.Logf("%s black hole 12 s: %d answered during it; workers that logged a dead connection: %d; %s",
				service, during, detected, tl)
			if service == "rabbitmq" && detected == 0 {
				t.Errorf("no worker detected its dead broker connection")
			}
		})
	}
}
