package amqp

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	amqp091 "github.com/onceler/onceler/internal/amqp091"
)

// TestIsConsumerTimeout: the close reasons RabbitMQ gives at its
// consumer_timeout are recognised, other 406 closes are not.
func TestIsConsumerTimeout(t *testing.T) {
	for _, c := range []struct {
		e    *amqp091.Error
		want bool
	}{
		{&amqp091.Error{Code: amqp091.PreconditionFailed, Server: true, Reason: "PRECONDITION_FAILED - delivery acknowledgement on channel 1 timed out. Timeout value used: 5000 ms. This timeout value can be configured, see consumers doc guide to learn more"}, true},
		{&amqp091.Error{Code: amqp091.PreconditionFailed, Server: true, Reason: "PRECONDITION_FAILED - consumer ack timed out on channel 1"}, true},
		{&amqp091.Error{Code: amqp091.PreconditionFailed, Server: true, Reason: "PRECONDITION_FAILED - unknown delivery tag 7"}, false},
		{&amqp091.Error{Code: amqp091.ConnectionForced, Server: true, Reason: "CONNECTION_FORCED - broker forced connection closure with reason 'shutdown'"}, false},
		{nil, false},
	} {
		if got := isConsumerTimeout(c.e); got != c.want {
			t.Errorf("isConsumerTimeout(%v) = %v, want %v", c.e, got, c.want)
		}
	}
	e := &amqp091.Error{Code: amqp091.PreconditionFailed, Reason: "PRECONDITION_FAILED - delivery acknowledgement on channel 1 timed out"}
	err := fmt.Errorf("channel closed: %w: %w", ErrConsumerTimeout, e)
	if !errors.Is(err, ErrConsumerTimeout) || IsTopologyError(err) {
		t.Errorf("%v: want ErrConsumerTimeout and not a topology error (Run reconnects)", err)
	}
}

// TestPublishTimeoutWaitsOutABlock: PublishOptions.Timeout does not run
// out while the broker blocks the publisher's connection; it does once the
// block is lifted (another full Timeout later at most), with
// context.DeadlineExceeded as the cause.
func TestPublishTimeoutWaitsOutABlock(t *testing.T) {
	p := NewPublisher(Config{URL: "amqp://127.0.0.1:1/"})
	s := &pubSession{dead: make(chan struct{})}
	p.cur = s
	const d = 50 * time.Millisecond

	ctx, stop := p.withTimeout(context.Background(), d)
	select {
	case <-ctx.Done():
	case <-time.After(10 * d):
		t.Fatal("not blocked: the timeout did not run out")
	}
	if c := context.Cause(ctx); !errors.Is(c, context.DeadlineExceeded) {
		t.Errorf("cause %v, want DeadlineExceeded", c)
	}
	stop()

	s.setBlocked(true)
	ctx, stop = p.withTimeout(context.Background(), d)
	defer stop()
	select {
	case <-ctx.Done():
		t.Fatalf("blocked: ended after less than %s (%v), want no end while the block lasts", 8*d, context.Cause(ctx))
	case <-time.After(8 * d):
	}
	s.setBlocked(false)
	select {
	case <-ctx.Done():
	case <-time.After(10 * d):
		t.Fatal("unblocked: the timeout did not run out")
	}
}
