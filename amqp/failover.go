package amqp

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	amqp091 "github.com/onceler/onceler/internal/amqp091"
)

// Addresses returns the broker URLs of c in failover order, as given: URLs,
// or URL split at ';'; blanks around each removed, empty elements dropped.
func (c Config) Addresses() []string {
	list := c.URLs
	if len(list) == 0 {
		list = strings.Split(c.URL, ";")
	}
	return splitURLs(list)
}

// splitURLs trims each element and drops the empty ones; an element may
// itself hold a ';'-separated list.
func splitURLs(list []string) []string {
	var out []string
	for _, l := range list {
		for _, u := range strings.Split(l, ";") {
			if u = strings.TrimSpace(u); u != "" {
				out = append(out, u)
			}
		}
	}
	return out
}

// DialURLs is DialURL for a failover list (a ';'-separated URL, as in
// Celery's broker_url): each URL as amqp091 dials it, in order. An error
// names the URL it is about (redacted) and its place in the list.
func DialURLs(raw string) ([]string, error) {
	eps, err := endpointsOf(splitURLs([]string{raw}))
	if err != nil {
		return nil, err
	}
	out := make([]string, len(eps))
	for i, e := range eps {
		out[i] = e.raw
	}
	return out, nil
}

// endpoint is one URL of the failover list, checked and ready to dial.
type endpoint struct {
	raw   string // as amqp091 dials it
	uri   amqp091.URI
	shown string // redacted, for logs and errors
}

// endpoints checks c's URLs and TLS settings.
func (c Config) endpoints() ([]endpoint, error) {
	if c.URL != "" && len(c.URLs) > 0 {
		return nil, fmt.Errorf("%w: give the broker URL or the URL list, not both", ErrConfig)
	}
	eps, err := endpointsOf(c.Addresses())
	if err != nil {
		return nil, err
	}
	tlsAny := false
	for _, e := range eps {
		tlsAny = tlsAny || e.uri.Scheme == "amqps"
	}
	if !tlsAny && !c.TLS.empty() {
		return nil, fmt.Errorf("%w: TLS files given for a non-TLS URL (use amqps://)", ErrConfig)
	}
	return eps, nil
}

// endpointsOf checks each URL of list.
func endpointsOf(list []string) ([]endpoint, error) {
	if len(list) == 0 {
		return nil, fmt.Errorf("%w: empty broker URL", ErrConfig)
	}
	eps := make([]endpoint, len(list))
	for i, u := range list {
		raw, uri, err := normalizeURL(u)
		if err != nil {
			if len(list) > 1 {
				// The list was split at each ';': an element that does not
				// parse may be a piece of a password holding a literal ';'.
				// Its error quotes no part of it (normalizeURL).
				return nil, fmt.Errorf("URL %d of the %d in the broker URL list (';' separates the URLs: a ';' in a password must be written %%3B): %w",
					i+1, len(list), err)
			}
			return nil, err
		}
		eps[i] = endpoint{raw: raw, uri: uri, shown: RedactURL(raw)}
	}
	return eps, nil
}

// failover chooses the URL of each connection attempt of one connection's
// owner (a consumer, a publisher): the current one, which moves to the next
// in the list, round robin, when an attempt to it fails or a connection to
// it is lost.
type failover struct {
	cfg Config
	log *zap.Logger
	eps []endpoint
	err error // a configuration error, returned by every dial

	mu  sync.Mutex
	cur int
}

func newFailover(cfg Config, log *zap.Logger) *failover {
	f := &failover{cfg: cfg, log: log}
	f.eps, f.err = cfg.endpoints()
	return f
}

// current returns the index of the URL the next attempt goes to.
func (f *failover) current() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.cur
}

// failed moves the next attempt on from URL i, unless it has already moved
// (another connection failed first): called after a failed attempt to i or
// the loss of a connection to it.
func (f *failover) failed(i int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.eps) < 2 || f.cur != i {
		return
	}
	f.cur = (i + 1) % len(f.eps)
	f.log.Warn("broker URL failed; the next connection attempt goes to the next URL of the list",
		zap.String("failed", f.eps[i].shown), zap.String("next", f.eps[f.cur].shown),
		zap.Int("urls", len(f.eps)))
}

// dial opens one connection to the current URL and returns it with the
// URL's index; a failed attempt moves on to the next URL.
func (f *failover) dial(ctx context.Context, role string) (*amqp091.Connection, int, error) {
	if f.err != nil {
		return nil, 0, f.err
	}
	i := f.current()
	cfg := f.cfg
	cfg.DialTimeout = f.attemptTimeout(ctx)
	conn, err := cfg.dialEndpoint(ctx, f.eps[i], role)
	if err != nil {
		if ctx.Err() == nil {
			f.failed(i)
		}
		return nil, i, err
	}
	return conn, i, nil
}

// attemptTimeout bounds one connection attempt (see Config.DialTimeout):
// DialTimeout for a single URL; with several, at most listDialTimeout
// unless DialTimeout was given, and under a ctx deadline at most the time
// left divided by the number of URLs (at least minListDialTimeout), so that
// a hung node does not use up the time the next URLs need.
func (f *failover) attemptTimeout(ctx context.Context) time.Duration {
	t := f.cfg.DialTimeout
	n := len(f.eps)
	if n < 2 {
		return t
	}
	if f.cfg.dialTimeoutDefault {
		t = min(t, listDialTimeout)
	}
	if d, ok := ctx.Deadline(); ok {
		t = min(t, max(time.Until(d)/time.Duration(n), minListDialTimeout))
	}
	return t
}

// shown returns URL i redacted.
func (f *failover) shown(i int) string {
	if i < 0 || i >= len(f.eps) {
		return ""
	}
	return f.eps[i].shown
}
