//go:build !linux

package idempotency

import (
	"syscall"
	"time"
)

// userTimeoutControl returns nil where TCP_USER_TIMEOUT is not available:
// keepalive and the pool's ping timeout still bound detection.
func userTimeoutControl(time.Duration) func(network, address string, c syscall.RawConn) error {
	return nil
}
