package amqp

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap/zaptest"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/intval"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// testConfig returns a Config on the test broker with a unique connection
// name and fast backoff.
func testConfig(t *testing.T) Config {
	t.Helper()
	return Config{
		URL:        testenv.AMQPURL(t),
		Name:       testenv.Name("onceler_amqp_test"),
		Logger:     zaptest.NewLogger(t),
		MinBackoff: 20 * time.Millisecond,
		MaxBackoff: 200 * time.Millisecond,
	}
}

// cleanupQueue deletes queue (and the exchange of the same name) when the
// test ends, on a connection of its own.
func cleanupQueue(t *testing.T, names ...string) {
	t.Helper()
	url := testenv.AMQPURL(t)
	t.Cleanup(func() { testkit.DeleteQueues(t, url, names...) })
}

// closeConnection closes, from the broker side, the connections whose name
// starts with prefix: only connections this test opened.
func closeConnection(t *testing.T, prefix string) int {
	t.Helper()
	if !strings.HasPrefix(prefix, "onceler_amqp_test_") {
		t.Fatalf("refusing to close a connection not named by this test: %q", prefix)
	}
	pids := testkit.ConnectionPIDs(t, prefix)
	testkit.CloseConnections(t, pids)
	return len(pids)
}

// declaredQueue declares a fresh Celery queue named after prefix (deleted
// when the test ends) and returns the test config, the queue's name, a
// publisher and a context that ends after d.
func declaredQueue(t *testing.T, prefix string, d time.Duration) (Config, string, *Publisher, context.Context) {
	t.Helper()
	cfg := testConfig(t)
	q := testenv.Name(prefix)
	cleanupQueue(t, q)
	p := newPublisher(t, cfg)
	ctx := ctxTimeout(t, d)
	must(t, p.Declare(ctx, CeleryQueue(q)), "declare")
	return cfg, q, p, ctx
}

// runConsumer runs c in the background; the returned stop cancels it and
// returns Run's error.
func runConsumer(t *testing.T, c *Consumer, handle func(*Delivery)) (stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx, handle) }()
	var once sync.Once
	var err error
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case err = <-done:
			case <-time.After(30 * time.Second):
				err = errors.New("consumer did not stop within 30s")
			}
		})
		return err
	}
	t.Cleanup(func() { _ = stop() })
	return stop
}

// newPublisher returns a Publisher closed when the test ends.
func newPublisher(t *testing.T, cfg Config) *Publisher {
	t.Helper()
	p := NewPublisher(cfg)
	t.Cleanup(func() { _ = p.Close() })
	return p
}

func textMessage(body string) *celeryproto.Publishing {
	return &celeryproto.Publishing{
		ContentType:     "application/json",
		ContentEncoding: "utf-8",
		Body:            []byte(body),
		DeliveryMode:    2,
	}
}

func ctxTimeout(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// recv waits for one delivery on ch.
func recv(t *testing.T, ch <-chan *Delivery, d time.Duration) *Delivery {
	t.Helper()
	select {
	case m := <-ch:
		return m
	case <-time.After(d):
		t.Fatalf("no delivery within %v", d)
		return nil
	}
}

// noRecv asserts no delivery arrives within d.
func noRecv(t *testing.T, ch <-chan *Delivery, d time.Duration) {
	t.Helper()
	select {
	case m := <-ch:
		t.Fatalf("unexpected delivery %q", m.Body)
	case <-time.After(d):
	}
}

func must(t *testing.T, err error, what string, args ...any) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", fmt.Sprintf(what, args...), err)
	}
}

// intOf reads an integer header value the broker handed back; 0 when it is
// none.
func intOf(v any) int64 {
	n, _ := intval.Int(v)
	return n
}
