// Package pause pauses a goroutine for a while, unless its context ends
// first.
package pause

import (
	"context"
	"time"
)

// For waits d, or until ctx is done; it reports whether the wait
// completed (false: ctx is done).
func For(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
