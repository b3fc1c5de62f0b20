package testkit

import (
	"context"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
)

// QueueDepth returns the number of ready messages in a queue of the broker
// at url, on a connection of its own; it fails tb if the queue cannot be
// inspected.
func QueueDepth(tb testing.TB, url, queue string) int {
	tb.Helper()
	conn, err := amqp091.Dial(url)
	if err != nil {
		tb.Fatalf("dial: %v", err)
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		tb.Fatalf("channel: %v", err)
	}
	defer func() { _ = ch.Close() }()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		tb.Fatalf("inspect queue %s: %v", queue, err)
	}
	return q.Messages
}

// DeleteQueues deletes queues (and the exchanges of the same names) of the
// broker at url, on a connection of its own; a failure is only logged: it
// is a test's cleanup.
func DeleteQueues(tb testing.TB, url string, names ...string) {
	tb.Helper()
	conn, err := amqp091.Dial(url)
	if err != nil {
		tb.Logf("cleanup: %v", err)
		return
	}
	defer func() { _ = conn.Close() }()
	for _, n := range names {
		ch, err := conn.Channel()
		if err != nil {
			return
		}
		_, _ = ch.QueueDelete(n, false, false, false)
		_ = ch.ExchangeDelete(n, false, false)
		_ = ch.Close()
	}
}

// ConnectionPIDs lists, through rabbitmqctl on the local broker node, the
// pids of the connections whose name (a client property) starts with one
// of the prefixes: only a test's own connections, by the names it gave
// them. Without rabbitmqctl the test is Unavailable.
func ConnectionPIDs(tb testing.TB, prefixes ...string) []string {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "rabbitmqctl", "-q", "list_connections", "pid", "client_properties").Output()
	if err != nil {
		Unavailable(tb, "rabbitmqctl list_connections: %v", err)
	}
	var pids []string
	for _, line := range strings.Split(string(out), "\n") {
		pid, props, ok := strings.Cut(line, "\t")
		_, name, named := strings.Cut(props, `{"connection_name","`)
		if !ok || !named {
			continue
		}
		for _, p := range prefixes {
			if strings.HasPrefix(name, p) {
				pids = append(pids, strings.TrimSpace(pid))
				break
			}
		}
	}
	return pids
}

// CloseConnections closes the connections with these pids from the broker
// side, all at the same time, and fails tb for any it could not close.
func CloseConnections(tb testing.TB, pids []string) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	errs := make(chan error, len(pids))
	for _, pid := range pids {
		go func() {
			out, err := exec.CommandContext(ctx, "rabbitmqctl", "-q", "close_connection", pid, "onceler test: broker-side close").CombinedOutput()
			if err != nil {
				err = fmt.Errorf("close_connection %s: %w: %s", pid, err, out)
			}
			errs <- err
		}()
	}
	for range pids {
		if err := <-errs; err != nil {
			tb.Errorf("%v", err)
		}
	}
}
