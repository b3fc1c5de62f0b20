package cmd

import (
	"bytes"
	"context"
	"net"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/onceler/onceler/internal/testenv"
)

// hungNode listens on a local port and accepts connections without ever
// answering: a RabbitMQ node whose VM hangs (SIGSTOP, a frozen host), or a
// TCP proxy in front of a dead node. It returns the address.
func hungNode(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu    sync.Mutex
		conns []net.Conn
	)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	})
	return ln.Addr().String()
}

// TestBrokerURLListHungFirstNode: the failover list's first node accepts
// TCP but never answers; the second is the live broker. A broker command
// ('quarantine list'; 'resolve --retry' and the worker's start-up probe
// take the same path: a publisher under connectTimeout, 10s) must fail
// over to the second URL: with several URLs each attempt gets its share
// of the command's time (an attempt lasting the whole default
// DialTimeout, 30s, would never let the second URL be tried).
func TestBrokerURLListHungFirstNode(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t)
	schema := testenv.Schema(t, pool)
	env := map[string]string{
		"ONCELER_DATABASE_URL": testenv.DatabaseURL(t),
		"ONCELER_SCHEMA":       schema,
		"ONCELER_BROKER_URL":   "amqp://guest:guest@" + hungNode(t) + "//;" + testenv.AMQPURL(t),
		"ONCELER_QUEUES":       testenv.Name("q"),
	}
	start := time.Now()
	r := runBin(t, env, "quarantine", "list")
	if r.code != 0 {
		t.Fatalf("quarantine list with a hung first node and a live second one: exit %d after %s\n%s",
			r.code, time.Since(start).Round(time.Second), r.stderr)
	}
}

// TestWorkerStartsWithHungFirstNode: 'onceler worker' with the same list
// (a hung first node, the live broker second) must start and consume from
// the second URL: its start-up probe (probeBroker, 10s) must not spend
// its time on the first URL's attempt and exit with "cannot reach
// RabbitMQ" while its consumer would have failed over.
func TestWorkerStartsWithHungFirstNode(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t)
	schema := testenv.Schema(t, pool)
	env := map[string]string{
		"ONCELER_DATABASE_URL": testenv.DatabaseURL(t),
		"ONCELER_SCHEMA":       schema,
		"ONCELER_MIGRATE":      "true",
		"ONCELER_BROKER_URL":   "amqp://guest:guest@" + hungNode(t) + "//;" + testenv.AMQPURL(t),
		"ONCELER_QUEUES":       testenv.Name("q"),
	}
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, "worker")
	cmd.Env = processEnv(env)
	var errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &errOut, &errOut
	start := time.Now()
	err := cmd.Run()
	if ctx.Err() == nil {
		t.Fatalf("worker exited after %s (%v) instead of failing over to the second URL:\n%s",
			time.Since(start).Round(time.Second), err, lastLines(errOut.String(), 3))
	}
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// TestBrokerURLSemicolonPasswordNotShown: a password holding a literal ';'
// (RFC 3986 allows it in userinfo; a single URL with it was refused
// before the URL lists too, without quoting it) is split as a list. The
// usage error must not show any part of the password; it quotes the part
// before the ';' in Go's "invalid port" message.
func TestBrokerURLSemicolonPasswordNotShown(t *testing.T) {
	t.Parallel()
	const secret = "Sup3rSecret"
	env := map[string]string{
		"ONCELER_DATABASE_URL": testenv.DatabaseURL(t),
		"ONCELER_BROKER_URL":   "amqp://app:" + secret + ";x@127.0.0.1:5672//",
		"ONCELER_QUEUES":       testenv.Name("q"),
	}
	line := oneLineError(t, runBin(t, env, "quarantine", "list"), 2)
	if strings.Contains(line, secret) {
		t.Errorf("the usage error shows the password: %s", line)
	}
}
