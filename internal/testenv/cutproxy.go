package testenv

import (
	"bytes"
	"context"
	"net"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// CutProxy forwards TCP to a server (PostgreSQL, or any other when only
// Freeze is used); when armed with a byte pattern, it
// forwards the first client write containing it, lets the server answer it
// (up to its ReadyForQuery: a statement sent with its Sync has committed by
// then) and cuts the connection instead of passing the answer on: the write
// took effect, the client never learns its outcome (a commit whose answer is
// lost).
type CutProxy struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	arm    []byte
	drop   bool // the armed write is not passed on: it never reaches the server
	lost   int
	frozen bool // the server's bytes are no longer passed on
	conns  []net.Conn
	wg     sync.WaitGroup
}

// NewCutProxy listens on a loopback port and forwards to target (host:port)
// until the test ends.
func NewCutProxy(tb testing.TB, target string) *CutProxy {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	p := &CutProxy{ln: ln, target: target}
	p.wg.Go(p.accept)
	tb.Cleanup(func() {
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

// Addr is the proxy's address.
func (p *CutProxy) Addr() string { return p.ln.Addr().String() }

// Arm makes the proxy cut the connection of the next client write that
// contains pattern, once.
func (p *CutProxy) Arm(pattern string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.arm, p.drop = []byte(pattern), false
}

// ArmDrop makes the proxy cut the connection of the next client write that
// contains pattern, once, without passing that write on: it never reaches
// the server (a statement that failed for certain, not one whose answer was
// lost).
func (p *CutProxy) ArmDrop(pattern string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.arm, p.drop = []byte(pattern), true
}

// Freeze stops passing the server's bytes on to the clients, the
// connections left open: a server gone silent (no answer, no heartbeat)
// without closing its socket. The clients' bytes still reach it.
func (p *CutProxy) Freeze() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.frozen = true
}

func (p *CutProxy) isFrozen() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.frozen
}

// Lost is how many of the cut connections' last writes the server answered
// in full before the cut: their answers were lost, their effects are there.
func (p *CutProxy) Lost() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.lost
}

func (p *CutProxy) accept() {
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
		cut := make(chan struct{})
		p.wg.Go(func() { p.back(c, s, cut) })
		p.wg.Go(func() { p.forward(c, s, cut) })
	}
}

// readyForQuery is PostgreSQL's ReadyForQuery message, up to its status byte.
var readyForQuery = []byte{'Z', 0, 0, 0, 5}

// back copies server s to client c; once cut is closed it passes nothing
// on, reads the server's answer up to its ReadyForQuery (5 s at most) and
// closes both.
func (p *CutProxy) back(c, s net.Conn, cut <-chan struct{}) {
	defer func() {
		_ = c.Close()
		_ = s.Close()
	}()
	buf := make([]byte, 64<<10)
	var answer []byte
	for {
		n, err := s.Read(buf)
		select {
		case <-cut:
			answer = append(answer, buf[:n]...)
			if bytes.Contains(answer, readyForQuery) {
				p.mu.Lock()
				p.lost++
				p.mu.Unlock()
				return
			}
		default:
			if n > 0 && !p.isFrozen() {
				if _, werr := c.Write(buf[:n]); werr != nil {
					return
				}
			}
		}
		if err != nil {
			return
		}
	}
}

// forward copies client c to server s until a write holds the armed
// pattern: it closes cut before passing that write on, and stops.
func (p *CutProxy) forward(c, s net.Conn, cut chan<- struct{}) {
	buf := make([]byte, 64<<10)
	for {
		n, err := c.Read(buf)
		if n > 0 {
			p.mu.Lock()
			hit := len(p.arm) > 0 && bytes.Contains(buf[:n], p.arm)
			drop := hit && p.drop
			if hit {
				p.arm = nil
			}
			p.mu.Unlock()
			if drop {
				_ = c.Close()
				_ = s.Close()
				return
			}
			if hit {
				close(cut)
				_ = s.SetReadDeadline(time.Now().Add(5 * time.Second))
			}
			if _, werr := s.Write(buf[:n]); werr != nil || hit {
				return
			}
		}
		if err != nil {
			_ = s.Close()
			return
		}
	}
}

// ProxiedPool returns a pool on the test database whose connections pass
// through a CutProxy, both closed when the test ends.
func ProxiedPool(tb testing.TB) (*pgxpool.Pool, *CutProxy) {
	tb.Helper()
	u, err := url.Parse(DatabaseURL(tb))
	if err != nil {
		tb.Fatal(err)
	}
	proxy := NewCutProxy(tb, u.Host)
	u.Host = proxy.Addr()
	pool, err := pgxpool.New(context.Background(), u.String())
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(pool.Close)
	return pool, proxy
}
