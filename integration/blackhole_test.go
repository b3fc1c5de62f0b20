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
	"github.com/onceler/onceler/internal/testkit"
)

// blackhole is a TCP proxy that can stop passing bytes, both ways, on every
// connection (established and new) while the sockets stay open: what a
// worker sees when the network between it and a service silently drops
// everything. Bytes held during the black hole are passed on after it, if
// the connection is still open by then. holdOld black-holes only the
// connections open at the call, and lets new ones through: what a worker
// sees when a firewall or NAT on the way silently forgets its connections.
//
// The proxy's own kernel still acknowledges what the worker sends, so the
// worker's TCP keepalive and TCP_USER_TIMEOUT never fire through it; what
// it can show is detection above TCP (the pool's ping before reuse, the
// record's per-write deadlines).
type blackhole struct {
	ln     net.Listener
	target string
	on     atomic.Bool
	seq    atomic.Int64 // connections accepted
	held   atomic.Int64 // connections numbered up to this are black-holed
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
		go b.serve(c, b.seq.Add(1))
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

// holdOld black-holes the connections accepted so far, until release.
func (b *blackhole) holdOld() { b.held.Store(b.seq.Load()) }

// release ends holdOld.
func (b *blackhole) release() { b.held.Store(0) }

func (b *blackhole) serve(c net.Conn, id int64) {
	defer b.wg.Done()
	if !b.track(c) || !b.pass(id) {
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
				if !b.pass(id) {
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

// pass waits while the black hole is on for connection id; false when the
// proxy closes.
func (b *blackhole) pass(id int64) bool {
	for b.on.Load() || id <= b.held.Load() {
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
// is answered, nothing lost, nothing done twice beyond the policy. (For
// PostgreSQL the 12 s are within every bound, so the workers wait it out;
// TestBlackholeIdlePostgres shows dead connections detected.)
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
				wl.send(task, wl.op("hole"+service, i))
			}
			testkit.Eventually(time.Minute, func() bool { return wl.answered() >= n/5 })
			hole.on.Store(true)
			at := wl.answered()
			time.Sleep(12 * time.Second)
			during := wl.answered() - at
			hole.on.Store(false)
			if !wl.wait(3 * time.Minute) {
				t.Errorf("%d of %d answered after the black hole", wl.answered(), n)
			}
			wl.stopWorkers()
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

// TestBlackholeIdlePostgres lets the workers' PostgreSQL connections go
// idle, then black-holes them for good (new connections pass), and sends
// more work: a worker must find its pooled connections dead within its
// detection bound (ONCELER_DATABASE_DEAD_AFTER), work through fresh ones,
// and answer everything while the old ones are still black-holed, before
// the record's 30 s write deadline would have cut them; nothing is lost or
// done twice. Through this proxy a dead connection found by the ping still
// holds its pool slot while pgx drains it on close (up to 15 s, pgconn's
// close deadline; a real black hole ends that drain with the kernel's
// keepalive), so the work resumes about deadAfter + 15 s after the cut.
func TestBlackholeIdlePostgres(t *testing.T) {
	const deadAfter = 2 * time.Second
	e := ownEnv(t, "ONCELER_DATABASE_DEAD_AFTER="+deadAfter.String())
	hole := newBlackhole(t, hostPort(t, e.DatabaseURL, "5432"))
	for range 2 {
		e.StartWorker(replay.WorkerOptions{DatabaseURL: via(t, e.DatabaseURL, hole.addr())})
	}
	wl := newWorkload(e)
	const n = 80
	tasks := []string{demo.TaskCredit, demo.TaskCharge, "replay.notify", "replay.audit"}
	for i := range n / 2 {
		wl.send(tasks[i%4], wl.op("idlehole", i))
	}
	if !wl.wait(time.Minute) {
		t.Fatalf("%d of %d answered before the black hole", wl.answered(), n/2)
	}
	// Idle for longer than the pool's ping threshold (1 s), then cut.
	time.Sleep(1500 * time.Millisecond)
	hole.holdOld()
	before := hole.seq.Load()
	start := time.Now()
	for i := n / 2; i < n; i++ {
		wl.send(tasks[i%4], wl.op("idlehole", i))
	}
	var first time.Duration
	testkit.Eventually(26*time.Second, func() bool {
		if first == 0 && wl.answered() > n/2 {
			first = time.Since(start)
		}
		return wl.answered() >= n
	})
	took, got := time.Since(start), wl.answered()
	fresh := hole.seq.Load() - before
	hole.release()
	if got < n {
		t.Errorf("with the old connections black-holed, %d of %d answered in %v: dead pooled connections not detected", got-n/2, n/2, took.Round(time.Second))
	} else if fresh == 0 {
		t.Errorf("all answered but no fresh connection was opened: the black hole did not hold")
	}
	if !wl.wait(2 * time.Minute) {
		t.Errorf("%d of %d answered after the black hole", wl.answered(), n)
	}
	wl.stopWorkers()
	tl := wl.check(t)
	t.Logf("old connections black-holed (%d of them), detection bound %v: first answer after %v, all %d after %v, %d fresh connections; %s",
		before, deadAfter, first.Round(10*time.Millisecond), n/2, took.Round(10*time.Millisecond), fresh, tl)
}
