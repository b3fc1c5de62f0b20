package control

import (
	"testing"
	"time"
)

func TestRevokedBoundAndExpiry(t *testing.T) {
	r := NewRevoked(3, time.Minute)
	now := time.Unix(1000, 0)
	r.now = func() time.Time { return now }
	r.Add("a", "b", "c")
	r.Add("d") // "a" is the oldest: it goes
	if r.Contains("a") || !r.Contains("b") || !r.Contains("d") || r.Len() != 3 {
		t.Fatalf("after overflow: %v", r.IDs())
	}
	now = now.Add(30 * time.Second)
	r.Add("b") // refreshed: now the newest
	now = now.Add(45 * time.Second)
	if r.Contains("c") || r.Contains("d") || !r.Contains("b") {
		t.Fatalf("after expiry: %v", r.IDs())
	}
	if snap := r.Snapshot(); len(snap) != 1 || snap["b"] != 1030 {
		t.Fatalf("snapshot = %v", snap)
	}
	now = now.Add(time.Minute)
	if r.Len() != 0 {
		t.Fatalf("all expired, still %v", r.IDs())
	}
}
