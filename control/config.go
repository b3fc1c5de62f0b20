package control

import (
	"crypto/tls"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"
)

// Defaults of Config.
const (
	// DefaultHeartbeat is how often worker-heartbeat is sent, as Celery does.
	DefaultHeartbeat = 2 * time.Second
	// DefaultEventBuffer is how many task events may wait to be published.
	DefaultEventBuffer = 8192
	// DefaultEventLinger is how long task events wait to be batched.
	DefaultEventLinger = 50 * time.Millisecond
	// DefaultNodeName is the node name pattern: unique per process.
	DefaultNodeName = "onceler-%p@%h"
	// DefaultRevokedMax and DefaultRevokedTTL bound the revoked-id set as
	// Celery does (50 000 ids, 3 hours).
	DefaultRevokedMax = 50000
	DefaultRevokedTTL = 3 * time.Hour
)

// Config configures a Controller. Zero values take the documented defaults.
type Config struct {
	// URL is the broker, amqp:// or amqps:// (pyamqp:// and a Celery-style
	// "//" vhost are accepted); several separated by ';' are a failover
	// list, as amqp.Config.URL's: after a failed attempt or a lost
	// connection the next attempt goes to the next URL. Required.
	URL string
	// TLS is the client TLS configuration for an amqps:// URL (CA, client
	// certificate). Nil: the system roots, no client certificate.
	TLS *tls.Config
	// DialTimeout bounds connecting (TCP, TLS and AMQP handshakes). Default
	// 30 s, and 5 s for each attempt to a URL of a failover list of several
	// (a hung node holds up the next URL no longer).
	DialTimeout time.Duration
	// dialTimeoutDefault: DialTimeout was not given.
	dialTimeoutDefault bool
	// ConnectionName is shown in RabbitMQ's management UI. Default
	// "onceler control <node>".
	ConnectionName string
	// NodeName is the worker's node name, "name@host". It may hold Celery's
	// substitutions %h (host name), %n (its first label), %d (its domain)
	// and %p or %i (process id). Default DefaultNodeName, unique per process.
	// Give the tasks.Worker the same name (see NodeName).
	NodeName string
	// TaskEvents turns task events on at start (Celery's -E / --events);
	// enable_events and disable_events switch them at run time. Worker
	// events (online, heartbeat, offline) are always sent.
	TaskEvents bool
	// Heartbeat is the worker-heartbeat interval. Default DefaultHeartbeat.
	Heartbeat time.Duration
	// EventBuffer bounds the task events waiting to be published; when it is
	// full new events are dropped and counted (Stats "events.dropped"),
	// never blocking a task. Default DefaultEventBuffer.
	EventBuffer int
	// EventLinger is how long the publisher waits to gather task events
	// into one task.multi message (up to 128). Default DefaultEventLinger.
	EventLinger time.Duration
	// Concurrency and Prefetch are reported by stats.
	Concurrency, Prefetch int
	// Shutdown is called when a shutdown command arrives (typically the
	// cancel function of the worker's context). Nil: shutdown is refused.
	Shutdown func()
	// RevokedMax and RevokedTTL bound the set of revoked ids the controller
	// remembers (inspect revoked, mingle hello). Defaults DefaultRevokedMax,
	// DefaultRevokedTTL.
	RevokedMax int
	RevokedTTL time.Duration
	// MinBackoff and MaxBackoff bound the reconnect delay. Defaults 100 ms
	// and 10 s.
	MinBackoff, MaxBackoff time.Duration
	// Logger receives structured logs. Default: none.
	Logger *zap.Logger
}

func (c *Config) setDefaults() error {
	if c.URL == "" {
		return errors.New("control: Config.URL is required")
	}
	name, err := NodeName(c.NodeName)
	if err != nil {
		return err
	}
	c.NodeName = name
	if c.ConnectionName == "" {
		c.ConnectionName = "onceler control " + c.NodeName
	}
	if c.DialTimeout <= 0 {
		c.DialTimeout, c.dialTimeoutDefault = 30*time.Second, true
	}
	if c.Heartbeat <= 0 {
		c.Heartbeat = DefaultHeartbeat
	}
	if c.EventBuffer <= 0 {
		c.EventBuffer = DefaultEventBuffer
	}
	if c.EventLinger <= 0 {
		c.EventLinger = DefaultEventLinger
	}
	if c.RevokedMax <= 0 {
		c.RevokedMax = DefaultRevokedMax
	}
	if c.RevokedTTL <= 0 {
		c.RevokedTTL = DefaultRevokedTTL
	}
	if c.MinBackoff <= 0 {
		c.MinBackoff = 100 * time.Millisecond
	}
	if c.MaxBackoff < c.MinBackoff {
		c.MaxBackoff = max(10*time.Second, c.MinBackoff)
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	return nil
}

// NodeName expands a node name pattern as Celery's -n does: %h is the host
// name, %n its first label, %d its domain, %p and %i the process id, %% a
// percent sign. An empty pattern is DefaultNodeName ("onceler-<pid>@<host>",
// unique per process); a pattern without "@" gets "@<host>" appended.
func NodeName(pattern string) (string, error) {
	if pattern == "" {
		pattern = DefaultNodeName
	}
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "localhost"
	}
	short, domain, _ := strings.Cut(host, ".")
	pid := strconv.Itoa(os.Getpid())
	var b strings.Builder
	for i := 0; i < len(pattern); i++ {
		c := pattern[i]
		if c != '%' || i+1 == len(pattern) {
			b.WriteByte(c)
			continue
		}
		i++
		switch pattern[i] {
		case 'h':
			b.WriteString(host)
		case 'n':
			b.WriteString(short)
		case 'd':
			b.WriteString(domain)
		case 'p', 'i':
			b.WriteString(pid)
		case '%':
			b.WriteByte('%')
		default:
			return "", fmt.Errorf("control: node name %q: unknown substitution %%%c", pattern, pattern[i])
		}
	}
	name := b.String()
	if !strings.Contains(name, "@") {
		name += "@" + host
	}
	if strings.HasPrefix(name, "@") {
		return "", fmt.Errorf("control: node name %q has no name before @", name)
	}
	return name, nil
}
