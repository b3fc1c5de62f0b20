package idempotency

import (
	"net"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// DefaultDeadConnectionAfter is the bound ConfigureDeadConnectionDetection
// uses when given zero: long enough that a busy but healthy server is never
// mistaken for a dead one, short enough that a worker cut off from
// PostgreSQL gives its work back well within a lease.
const DefaultDeadConnectionAfter = 15 * time.Second

// ConfigureDeadConnectionDetection makes the connections of cfg detect a
// silently dead peer (a network black hole: packets dropped, no reset)
// within about after (DefaultDeadConnectionAfter when zero or less), where
// by default a connection would wait for the operating system's two-hour
// keepalive or for ever. A connection found dead fails its pending call
// with a network error and is closed; the pool opens a fresh one for the
// next call.
//
// It sets three things:
//
//   - cfg.ConnConfig.DialFunc: a dialer whose TCP keepalive probes an idle
//     connection after after/3 of silence, then every after/6, and gives up
//     after 4 unanswered probes (a dead idle connection is closed in about
//     after).
//   - On Linux, TCP_USER_TIMEOUT of after on the same sockets: a
//     connection whose sent bytes stay unacknowledged for after is closed,
//     which covers a connection that dies while a query is in flight
//     (keepalive only probes idle connections). A long-running query on a
//     healthy connection is not affected: the server acknowledges it.
//   - cfg.PingTimeout of after (when not set already): a connection that
//     sat idle in the pool is pinged before use and destroyed when the
//     ping is not answered within after, so a call does not wait on it.
//
// A connection found dead by the ping keeps its place in the pool while
// pgx closes it, which waits for the peer up to 15 s unless the kernel has
// given the socket up first (as keepalive does in a real black hole).
//
// Writes of the record are bounded separately, per attempt: a flush by
// BatchConfig.Timeout, and the worker's final writes by their own
// deadline; when such a deadline cuts a call, pgx closes its connection,
// so the next attempt uses another one.
//
// A DialFunc already in cfg is replaced. Call it after pgxpool.ParseConfig
// and before pgxpool.NewWithConfig.
func ConfigureDeadConnectionDetection(cfg *pgxpool.Config, after time.Duration) {
	if after <= 0 {
		after = DefaultDeadConnectionAfter
	}
	d := deadConnectionDialer(after)
	cfg.ConnConfig.DialFunc = d.DialContext
	if cfg.PingTimeout <= 0 {
		cfg.PingTimeout = after
	}
}

// deadConnectionDialer returns the dialer ConfigureDeadConnectionDetection
// installs.
func deadConnectionDialer(after time.Duration) *net.Dialer {
	idle := max(after/3, time.Second)
	interval := max(after/6, time.Second)
	return &net.Dialer{
		// The same bound as pgconn's default dialer.
		Timeout: 5 * time.Minute,
		KeepAliveConfig: net.KeepAliveConfig{
			Enable:   true,
			Idle:     idle,
			Interval: interval,
			Count:    4,
		},
		Control: userTimeoutControl(after),
	}
}
