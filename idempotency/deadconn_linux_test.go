package idempotency_test

import (
	"context"
	"errors"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
)

// sockopt reads an integer TCP-level (or socket-level) option of c.
func sockopt(t *testing.T, c net.Conn, level, opt int) int {
	t.Helper()
	tc, ok := c.(*net.TCPConn)
	if !ok {
		t.Skipf("connection is %T, not TCP", c)
	}
	raw, err := tc.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var v int
	var gerr error
	if err := raw.Control(func(fd uintptr) { v, gerr = syscall.GetsockoptInt(int(fd), level, opt) }); err != nil {
		t.Fatal(err)
	}
	if gerr != nil {
		t.Fatal(gerr)
	}
	return v
}

// TestDeadConnectionDetectionSockets opens a real pool connection with
// ConfigureDeadConnectionDetection and reads back, from the socket, the
// keepalive and TCP_USER_TIMEOUT the kernel will apply.
func TestDeadConnectionDetectionSockets(t *testing.T) {
	cfg, err := pgxpool.ParseConfig(testenv.DatabaseURL(t))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.ConnConfig.Host == "" || cfg.ConnConfig.Host[0] == '/' {
		testenv.Unavailable(t, "PostgreSQL is reached through a Unix socket, not TCP")
	}
	idempotency.ConfigureDeadConnectionDetection(cfg, 6*time.Second)
	if cfg.PingTimeout != 6*time.Second {
		t.Errorf("PingTimeout = %v, want 6s", cfg.PingTimeout)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	c, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release()
	nc := c.Conn().PgConn().Conn()
	for _, o := range []struct {
		name       string
		level, opt int
		want       int
	}{
		{"SO_KEEPALIVE", syscall.SOL_SOCKET, syscall.SO_KEEPALIVE, 1},
		{"TCP_KEEPIDLE", syscall.IPPROTO_TCP, syscall.TCP_KEEPIDLE, 2},
		{"TCP_KEEPINTVL", syscall.IPPROTO_TCP, syscall.TCP_KEEPINTVL, 1},
		{"TCP_KEEPCNT", syscall.IPPROTO_TCP, syscall.TCP_KEEPCNT, 4},
		{"TCP_USER_TIMEOUT", syscall.IPPROTO_TCP, 0x12, 6000},
	} {
		if got := sockopt(t, nc, o.level, o.opt); got != o.want {
			t.Errorf("%s = %d, want %d", o.name, got, o.want)
		}
	}
	if err := c.Ping(ctx); err != nil {
		t.Fatalf("ping through the configured dialer: %v", err)
	}
}

// TestDeadConnectionDetectionStalledPeer dials, with the configured
// dialer, a peer that never takes the bytes sent to it (its kernel keeps
// answering, with a closed window): the kernel gives the connection up
// with ETIMEDOUT about the detection bound after the peer stopped, where a
// plain connection would wait for ever.
func TestDeadConnectionDetectionStalledPeer(t *testing.T) {
	const after = 2 * time.Second
	cfg, err := pgxpool.ParseConfig("postgres://nobody@127.0.0.1:1/none")
	if err != nil {
		t.Fatal(err)
	}
	idempotency.ConfigureDeadConnectionDetection(cfg, after)
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		return c.Control(func(fd uintptr) { _ = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096) })
	}}
	ln, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			close(accepted)
			return
		}
		accepted <- c // held open, never read
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := cfg.ConnConfig.DialFunc(ctx, "tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if peer, ok := <-accepted; ok {
		defer peer.Close()
	}
	// Fill the peer's window; a write that takes more than 100 ms means
	// it is closed and the kernel is probing.
	buf := make([]byte, 64<<10)
	var stalled time.Time
	_ = c.SetWriteDeadline(time.Now().Add(15 * time.Second))
	for {
		start := time.Now()
		_, err = c.Write(buf)
		if err != nil {
			if stalled.IsZero() {
				stalled = start
			}
			break
		}
		if time.Since(start) > 100*time.Millisecond && stalled.IsZero() {
			stalled = start
		}
	}
	took := time.Since(stalled)
	t.Logf("stalled peer detected after %v (bound %v): %v", took.Round(10*time.Millisecond), after, err)
	if !errors.Is(err, syscall.ETIMEDOUT) {
		t.Fatalf("write ended with %v, want the kernel's ETIMEDOUT", err)
	}
	if took > 4*after {
		t.Errorf("detection took %v, more than 4x the bound %v", took, after)
	}
}
