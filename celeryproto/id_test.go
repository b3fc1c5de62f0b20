package celeryproto

import (
	"regexp"
	"testing"
)

// TestNewTaskID: a version 4 UUID (RFC 4122 variant), different each time.
func TestNewTaskID(t *testing.T) {
	re := regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)
	seen := map[string]bool{}
	for range 100 {
		id := NewTaskID()
		if !re.MatchString(id) || seen[id] {
			t.Fatalf("NewTaskID() = %q: not a fresh version 4 UUID", id)
		}
		seen[id] = true
	}
}
