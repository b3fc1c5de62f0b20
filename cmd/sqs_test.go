package cmd

import (
	"errors"
	"strings"
	"testing"
)

// TestSQSWorkerUsage: RabbitMQ's and Celery's flags, Sidekiq, and SQS
// settings out of range are refused with --sqs, in one usage line, before
// any service is reached.
func TestSQSWorkerUsage(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--sidekiq", "redis://127.0.0.1:1/0"}, "exclude each other"},
		{[]string{"--quorum"}, "not with --sqs"},
		{[]string{"--queue-arg", "x-max-priority=10"}, "not with --sqs"},
		{[]string{"--events"}, "no remote control nor events"},
		{[]string{"--sqs-visibility", "1s"}, "at least 2s"},
		{[]string{"--sqs-visibility", "13h"}, "between 0 and 12h"},
		{[]string{"--sqs-wait", "30s"}, "between 0 and 20s"},
		{[]string{"--queues", "=demo.add"}, "a task without a queue name"},
		{[]string{"--queues", ","}, "names no queue"},
	} {
		args := append([]string{"worker", "--sqs", "--sqs-endpoint", "http://127.0.0.1:1"}, tc.args...)
		r := runIn(t, nil, args...)
		var u *usageError
		if !errors.As(r.err, &u) || !strings.Contains(r.err.Error(), tc.want) {
			t.Errorf("%v: %v, want a usage error saying %q", tc.args, r.err, tc.want)
		}
	}
}
