package cmd

import (
	"reflect"
	"testing"
)

// TestEdgeQueueArgValueWithColonAndEquals: queueArgItem's comment says a
// value may hold anything but ','; a value holding ':' and then '=' (a
// dead-letter routing key "tenant:a=b") must be read as the value of an
// argument for every queue, not as a queue name "x-...=tenant" that is
// not among --queues. Quoting the value does not help either.
func TestEdgeQueueArgValueWithColonAndEquals(t *testing.T) {
	t.Parallel()
	names := []string{"orders"}
	for item, want := range map[string]map[string]map[string]any{
		"x-dead-letter-routing-key=tenant:a=b":        {"orders": {"x-dead-letter-routing-key": "tenant:a=b"}},
		`x-dead-letter-routing-key="tenant:a=b"`:      {"orders": {"x-dead-letter-routing-key": "tenant:a=b"}},
		"orders:x-dead-letter-routing-key=tenant:a=b": {"orders": {"x-dead-letter-routing-key": "tenant:a=b"}},
		`orders:x-dead-letter-exchange="dlx:v=2"`:     {"orders": {"x-dead-letter-exchange": "dlx:v=2"}},
	} {
		got, err := parseQueueArgs([]string{item}, names)
		if err != nil || !reflect.DeepEqual(got, want) {
			t.Errorf("parseQueueArgs(%q) = %v, %v; want %v", item, got, err, want)
		}
	}
}
