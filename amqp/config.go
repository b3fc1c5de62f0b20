package amqp

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	amqp091 "github.com/onceler/onceler/internal/amqp091"
)

// Defaults applied to a zero Config.
const (
	DefaultHeartbeat   = 10 * time.Second
	DefaultMinBackoff  = 100 * time.Millisecond
	DefaultMaxBackoff  = 30 * time.Second
	defaultDialTimeout = 30 * time.Second
)

// Config says how to reach the broker. The zero value of every field but URL
// (or URLs) has a working default.
type Config struct {
	// URL is the broker address: amqp:// or amqps://, and Celery's pyamqp://.
	// The Celery spelling "amqp://host:5672//" names vhost "/", as do a
	// trailing "/" and no path at all; "/%2f" works too. Several addresses
	// separated by ';', as in Celery's broker_url, are a failover list: see
	// URLs.
	URL string
	// URLs is the failover list in the Go API, for nodes of one RabbitMQ
	// cluster: each connection attempt goes to one URL, the first attempt to
	// the first URL; after a failed attempt, or the loss of a connection, the
	// next attempt goes to the next URL, round robin, after the usual
	// backoff (MinBackoff, MaxBackoff). A connection stays on the URL it
	// reached: failover, not load balancing. Blanks around each URL and
	// empty elements are ignored. Give URL or URLs, not both. TLS applies to
	// the amqps:// URLs of a list; the broker's certificate is verified
	// against each URL's host unless TLS.ServerName is set.
	URLs []string
	// TLS gives the files for an amqps:// URL. Setting any of them for an
	// amqp:// URL is an error: it would silently not be used.
	TLS TLSConfig
	// Heartbeat is the heartbeat interval asked of the broker; default 10s.
	Heartbeat time.Duration
	// Name is the connection name shown by the management UI and
	// rabbitmqctl; default "onceler@<hostname>". The consumer's connection
	// gets the suffix " consume" and the publisher's " publish".
	Name string
	// Logger receives connection events; nil logs nothing.
	Logger *zap.Logger
	// MinBackoff and MaxBackoff bound the jittered exponential wait between
	// connection attempts; defaults 100ms and 30s.
	MinBackoff, MaxBackoff time.Duration
	// DialTimeout bounds the TCP connect plus the TLS and AMQP handshakes of
	// one attempt; default 30s, and 5s for each attempt to a URL of a
	// failover list of several, so that a node that accepts connections but
	// never answers (a hung VM) holds up the next URL for 5s only. An
	// attempt under a context deadline (a command's first contact) gets
	// its share of the time left: at most the time left divided by the
	// number of URLs, and at least 2s, so that every URL of the list is
	// tried within it.
	DialTimeout time.Duration

	// dialTimeoutDefault: DialTimeout was not given (withDefaults).
	dialTimeoutDefault bool
}

// Per-attempt bounds with a failover list of several URLs (see
// Config.DialTimeout).
const (
	listDialTimeout    = 5 * time.Second
	minListDialTimeout = 2 * time.Second
)

// TLSConfig names the PEM files used for amqps:// connections.
type TLSConfig struct {
	// CAFile is the CA bundle that verifies the broker; empty uses the
	// system roots.
	CAFile string
	// CertFile and KeyFile are the client certificate and key for mutual
	// TLS; both or neither.
	CertFile, KeyFile string
	// ServerName overrides the name verified in the broker's certificate;
	// default the URL's host.
	ServerName string
}

func (t TLSConfig) empty() bool {
	return t == TLSConfig{}
}

// withDefaults returns a copy of c with its zero fields filled in.
func (c Config) withDefaults() Config {
	if c.Heartbeat <= 0 {
		c.Heartbeat = DefaultHeartbeat
	}
	if c.MinBackoff <= 0 {
		c.MinBackoff = DefaultMinBackoff
	}
	if c.MaxBackoff <= 0 {
		c.MaxBackoff = DefaultMaxBackoff
	}
	if c.MaxBackoff < c.MinBackoff {
		c.MaxBackoff = c.MinBackoff
	}
	if c.DialTimeout <= 0 {
		c.DialTimeout, c.dialTimeoutDefault = defaultDialTimeout, true
	}
	if c.Name == "" {
		host, err := os.Hostname()
		if err != nil || host == "" {
			host = "localhost"
		}
		c.Name = "onceler@" + host
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	return c
}

// RedactURL returns raw with its password replaced by "xxxxx", for logs and
// error messages. A URL that cannot be parsed, or whose credentials are not
// where a URL keeps them (no "//" before them: they would be read as a path
// or an opaque part), is replaced whole, since where its password lies is
// unknown. Each URL of a ';'-separated list is redacted on its own.
func RedactURL(raw string) string {
	if strings.Contains(raw, ";") {
		parts := strings.Split(raw, ";")
		for i, p := range parts {
			parts[i] = RedactURL(p)
		}
		return strings.Join(parts, ";")
	}
	u, err := url.Parse(raw)
	if err != nil || u.Scheme == "" || u.Opaque != "" || strings.Contains(u.Path+u.RawQuery+u.Fragment, "@") {
		return "<unparsable URL>"
	}
	if u.User != nil {
		if _, has := u.User.Password(); has {
			u.User = url.UserPassword(u.User.Username(), "xxxxx")
		}
	}
	return u.String()
}

// DialURL returns raw as amqp091 dials it: Celery's spellings (pyamqp://,
// pyamqps://, surrounding blanks) mapped onto amqp:// and amqps://, and the
// result checked. A Celery-style "host//" names vhost "/", as amqp091 reads
// it. Its errors never contain the URL (they wrap ErrConfig).
func DialURL(raw string) (string, error) {
	s, _, err := normalizeURL(raw)
	return s, err
}

// normalizeURL maps Celery's spellings onto what amqp091 parses, and checks
// the result. Its errors never contain the URL (a url.Error would quote the
// password).
func normalizeURL(raw string) (string, amqp091.URI, error) {
	s := strings.TrimSpace(raw)
	if s == "" {
		return "", amqp091.URI{}, fmt.Errorf("%w: empty broker URL", ErrConfig)
	}
	switch {
	case strings.HasPrefix(s, "pyamqp://"):
		s = "amqp://" + strings.TrimPrefix(s, "pyamqp://")
	case strings.HasPrefix(s, "pyamqps://"):
		s = "amqps://" + strings.TrimPrefix(s, "pyamqps://")
	}
	if strings.Contains(s, ";") {
		return "", amqp091.URI{}, fmt.Errorf("%w: broker URL %s: one URL expected here, not a list", ErrConfig, RedactURL(s))
	}
	if scheme, _, ok := strings.Cut(s, "://"); !ok || !strings.EqualFold(scheme, "amqp") && !strings.EqualFold(scheme, "amqps") {
		// amqp091 reads "amqp:user:pw@host" (no "//") as a URL without a
		// host and dials localhost with the default credentials.
		return "", amqp091.URI{}, fmt.Errorf("%w: broker URL %s: must start with amqp://, amqps://, pyamqp:// or pyamqps://", ErrConfig, RedactURL(s))
	}
	uri, err := amqp091.ParseURI(s)
	if err != nil {
		var (
			ue *url.Error
			ne *strconv.NumError
		)
		if errors.As(err, &ue) || errors.As(err, &ne) {
			// url.Parse's and strconv's messages quote the part they could
			// not read, which may be part of the password (the text before
			// a literal ';' or '/' in it reads as an "invalid port").
			return "", amqp091.URI{}, fmt.Errorf("%w: broker URL %s cannot be parsed: a reserved character in its user name or password "+
				"must be percent-encoded (';' as %%3B, '/' as %%2F, '@' as %%40, ':' as %%3A, '#' as %%23, '?' as %%3F)", ErrConfig, RedactURL(s))
		}
		return "", amqp091.URI{}, fmt.Errorf("%w: broker URL %s: %v", ErrConfig, RedactURL(s), err)
	}
	return s, uri, nil
}

// TLSClientConfig builds the client TLS configuration that the consumer
// and publisher use for c.URL: TLS 1.2 or later, the broker verified against
// TLS.CAFile (default the system roots) under TLS.ServerName (default the
// URL's host), and the client certificate of TLS.CertFile and TLS.KeyFile.
// It is nil when no URL is amqps:// and no TLS file is given. For a
// failover list (URLs, or URL with ';') without TLS.ServerName, ServerName
// is left empty, and amqp091 verifies each amqps:// URL's own host (on a
// clone per connection: it sets ServerName in the config it is given).
// Errors wrap ErrConfig: an unparsable URL, TLS files with no amqps://
// URL, unreadable files, a certificate without its key. Give it to other
// connections to the same broker (e.g. control.Config.TLS) so that they
// present the same client certificate.
func (c Config) TLSClientConfig() (*tls.Config, error) {
	eps, err := c.endpoints()
	if err != nil {
		return nil, err
	}
	var tc *tls.Config
	for _, e := range eps {
		if e.uri.Scheme == "amqps" {
			if tc, err = c.tlsConfig(e.uri); err != nil {
				return nil, err
			}
			break
		}
	}
	if tc != nil && len(eps) > 1 && c.TLS.ServerName == "" {
		tc.ServerName = ""
	}
	return tc, nil
}

// tlsConfig builds the client TLS configuration for uri: nil for amqp://
// (endpoints refuses TLS files when no URL is amqps://).
func (c Config) tlsConfig(uri amqp091.URI) (*tls.Config, error) {
	if uri.Scheme != "amqps" {
		return nil, nil
	}
	tc := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: c.TLS.ServerName}
	if tc.ServerName == "" {
		tc.ServerName = uri.Host
	}
	if c.TLS.CAFile != "" {
		pem, err := os.ReadFile(c.TLS.CAFile)
		if err != nil {
			return nil, fmt.Errorf("%w: read TLS CA file: %w", ErrConfig, err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("%w: TLS CA file %s holds no PEM certificate", ErrConfig, c.TLS.CAFile)
		}
		tc.RootCAs = pool
	}
	if (c.TLS.CertFile == "") != (c.TLS.KeyFile == "") {
		return nil, fmt.Errorf("%w: TLS CertFile and KeyFile go together", ErrConfig)
	}
	if c.TLS.CertFile != "" {
		cert, err := tls.LoadX509KeyPair(c.TLS.CertFile, c.TLS.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("%w: load TLS client certificate: %w", ErrConfig, err)
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}

// dialEndpoint opens one connection to e, bounded by ctx and DialTimeout.
// role is appended to the connection name.
func (c Config) dialEndpoint(ctx context.Context, e endpoint, role string) (*amqp091.Connection, error) {
	raw, uri := e.raw, e.uri
	tc, err := c.tlsConfig(uri)
	if err != nil {
		return nil, err
	}
	props := amqp091.NewConnectionProperties()
	props.SetClientConnectionName(c.Name + " " + role)
	deadline := time.Now().Add(c.DialTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	var (
		mu      sync.Mutex
		netConn net.Conn
	)
	cfg := amqp091.Config{
		Heartbeat:       c.Heartbeat,
		TLSClientConfig: tc,
		Properties:      props,
		Dial: func(network, addr string) (net.Conn, error) {
			d := net.Dialer{Deadline: deadline}
			conn, err := d.DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			// Handshake deadline; amqp091 clears it once the connection is open.
			if err := conn.SetDeadline(deadline); err != nil {
				_ = conn.Close()
				return nil, err
			}
			mu.Lock()
			netConn = conn
			mu.Unlock()
			return conn, nil
		},
	}
	// Cancelling ctx during the TLS or AMQP handshake unblocks it.
	stop := context.AfterFunc(ctx, func() {
		mu.Lock()
		defer mu.Unlock()
		if netConn != nil {
			_ = netConn.SetDeadline(time.Unix(1, 0))
		}
	})
	conn, err := amqp091.DialConfig(raw, cfg)
	if !stop() && err == nil {
		_ = conn.Close()
		return nil, fmt.Errorf("dial %s: %w", RedactURL(raw), ctx.Err())
	}
	if err != nil {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("dial %s: %w", RedactURL(raw), ctx.Err())
		}
		return nil, fmt.Errorf("dial %s: %w", RedactURL(raw), err)
	}
	return conn, nil
}

// backoff yields jittered exponential waits between attempts.
type backoff struct {
	min, max time.Duration
	attempt  int
}

// next returns the wait before the next attempt: uniformly random in
// [d/2, d) where d doubles from min up to max.
func (b *backoff) next() time.Duration {
	d := b.min
	for i := 0; i < b.attempt && d < b.max; i++ {
		d *= 2
	}
	d = min(d, b.max)
	b.attempt++
	half := d / 2
	if half <= 0 {
		return d
	}
	return half + rand.N(half)
}

func (b *backoff) reset() { b.attempt = 0 }
