package uuid

import (
	"regexp"
	"testing"
)

var v4 = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)

func TestNewIsVersion4AndRandom(t *testing.T) {
	seen := map[string]bool{}
	for range 1000 {
		id := New()
		if !v4.MatchString(id) {
			t.Fatalf("New() = %q, not a version 4 UUID", id)
		}
		if seen[id] {
			t.Fatalf("New() repeated %q", id)
		}
		seen[id] = true
	}
}

func TestFormKeepsAllButVersionAndVariant(t *testing.T) {
	var b [16]byte
	for i := range b {
		b[i] = 0xff
	}
	if got, want := Form(b), "ffffffff-ffff-4fff-bfff-ffffffffffff"; got != want {
		t.Fatalf("Form(all ones) = %q, want %q", got, want)
	}
	if got, want := Form([16]byte{}), "00000000-0000-4000-8000-000000000000"; got != want {
		t.Fatalf("Form(zeros) = %q, want %q", got, want)
	}
}
