package testkit

import (
	"testing"
	"time"
)

// Eventually polls cond every 50 ms until it holds (true) or timeout
// passes (false).
func Eventually(timeout time.Duration, cond func() bool) bool {
	return poll(timeout, 50*time.Millisecond, cond)
}

// WaitFor polls cond every 10 ms until it holds, and fails tb if it does
// not within timeout.
func WaitFor(tb testing.TB, what string, timeout time.Duration, cond func() bool) {
	tb.Helper()
	if !poll(timeout, 10*time.Millisecond, cond) {
		tb.Fatalf("timed out after %v waiting for %s", timeout, what)
	}
}

func poll(timeout, every time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(every)
	}
}
