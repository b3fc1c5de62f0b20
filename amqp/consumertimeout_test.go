package amqp

import (
	"errors"
	"fmt"
	"testing"

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
