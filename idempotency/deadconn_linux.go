package idempotency

import (
	"fmt"
	"syscall"
	"time"
)

// tcpUserTimeout is TCP_USER_TIMEOUT from linux/tcp.h (the syscall package
// does not name it).
const tcpUserTimeout = 0x12

// userTimeoutControl sets TCP_USER_TIMEOUT on a socket before it connects:
// the kernel closes the connection when data it sent stays unacknowledged
// for after.
func userTimeoutControl(after time.Duration) func(network, address string, c syscall.RawConn) error {
	ms := int(after.Milliseconds())
	return func(network, address string, c syscall.RawConn) error {
		if network != "tcp" && network != "tcp4" && network != "tcp6" {
			return nil
		}
		var serr error
		err := c.Control(func(fd uintptr) {
			serr = syscall.SetsockoptInt(int(fd), syscall.IPPROTO_TCP, tcpUserTimeout, ms)
		})
		if err != nil {
			return fmt.Errorf("set TCP_USER_TIMEOUT: %w", err)
		}
		if serr != nil {
			return fmt.Errorf("set TCP_USER_TIMEOUT: %w", serr)
		}
		return nil
	}
}
