package cmd

import (
	"errors"
	"fmt"
	"strings"
	"testing"
)

// TestSidekiqQueuesFlag: with --sidekiq, --queues is Sidekiq's: names in
// strict order, or a number after a name as its weight.
func TestSidekiqQueuesFlag(t *testing.T) {
	t.Parallel()
	for spec, want := range map[string]string{
		"default":                 "[default]",
		"critical, low":           "[critical low]",
		"critical,2,default,1":    "[critical,2 default,1]",
		"critical,3,default,low,": "[critical,3 default low]",
		"2,critical":              "error",
		"critical,2,3":            "error",
		",":                       "error",
	} {
		got, err := sidekiqQueues(spec)
		if s := fmt.Sprint(got); (err != nil) != (want == "error") || (err == nil && s != want) {
			t.Errorf("sidekiqQueues(%q) = %s, %v; want %s", spec, s, err, want)
		}
	}
}

// TestSidekiqWorkerUsage: RabbitMQ's and Celery's flags are refused with
// --sidekiq, as is a heartbeat too short, in one usage line, before any
// service is reached.
func TestSidekiqWorkerUsage(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--quorum"}, "not with --sidekiq"},
		{[]string{"--queue-arg", "x-max-priority=10"}, "not with --sidekiq"},
		{[]string{"--events"}, "no remote control nor events"},
		{[]string{"--no-control"}, "no remote control nor events"},
		{[]string{"--sidekiq-heartbeat", "100ms"}, "at least 500ms"},
		{[]string{"--queues", "2,critical"}, "weight 2 follows no queue name"},
	} {
		args := append([]string{"worker", "--sidekiq", "redis://:secret@127.0.0.1:1/0"}, tc.args...)
		r := runIn(t, nil, args...)
		var u *usageError
		if !errors.As(r.err, &u) || !strings.Contains(r.err.Error(), tc.want) || strings.Contains(r.err.Error(), "secret") {
			t.Errorf("%v: %v, want a usage error saying %q", tc.args, r.err, tc.want)
		}
	}
}
