package tasks

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"

	"github.com/onceler/onceler/internal/clip"
)

// TaskKeyPrefix is the prefix of the key of a task's meta in a key-value
// result backend, as Celery's BaseKeyValueStoreBackend.task_keyprefix.
const TaskKeyPrefix = "celery-task-meta-"

// maxRedisValue is the longest string value Redis stores (512 MB), as
// Celery's RedisBackend._MAX_STR_VALUE_SIZE.
const maxRedisValue = 512 << 20

// storeMeta is Celery's RedisBackend store of a task meta in one atomic
// step: Backend._store_result's check (a SUCCESS already stored is never
// replaced: a late duplicate or a lost worker's outcome cannot overwrite
// it), then _set's SETEX (SET without expiry) and PUBLISH on the key's
// channel, which wakes a waiting AsyncResult.get(). The stored meta may be
// JSON, msgpack or YAML (the callers' result_serializer).
// KEYS[1] key; ARGV[1] meta, ARGV[2] expiry in seconds (0: none).
var storeMeta = redis.NewScript(`
local cur = redis.call('GET', KEYS[1])
if cur then
  local st
  local ok, m = pcall(cjson.decode, cur)
  if ok and type(m) == 'table' then
    st = m['status']
  else
    ok, m = pcall(cmsgpack.unpack, cur)
    if ok and type(m) == 'table' then
      st = m['status']
    elseif string.sub(cur, 1, 16) == 'status: SUCCESS\n' or string.find(cur, '\nstatus: SUCCESS\n', 1, true) then
      st = 'SUCCESS'
    end
  end
  if st == 'SUCCESS' then
    return 0
  end
end
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('SETEX', KEYS[1], ttl, ARGV[1])
else
  redis.call('SET', KEYS[1], ARGV[1])
end
redis.call('PUBLISH', KEYS[1], ARGV[1])
return 1
`)

type redisBackend struct {
	c       *redis.Client
	expires int64 // seconds; 0: no expiry
	url     string
	// maxValue is the server's proto-max-bulk-len as last read (ping),
	// else maxRedisValue: a longer value is refused before it is sent (the
	// server would close the connection under it, which looks like an
	// outage).
	maxValue atomic.Int64
}

func newRedisBackend(raw string, cfg *Config) (*redisBackend, error) {
	opt, err := redisOptions(raw)
	if err != nil {
		return nil, err
	}
	b := &redisBackend{url: redactURL(raw)}
	if cfg.ResultExpires > 0 {
		// Celery's RedisBackend keeps expires as an int of seconds.
		b.expires = max(1, int64(cfg.ResultExpires/time.Second))
	}
	b.c = redis.NewClient(opt)
	return b, nil
}

// redisOptions reads a Celery Redis result backend URL:
// redis://[[user]:password@]host[:port][/db], rediss://... (TLS; the query
// may hold ssl_cert_reqs, ssl_ca_certs, ssl_certfile, ssl_keyfile as in
// Celery) and redis+socket:///path (the database in ?virtual_host=N or
// ?db=N). socket_timeout and socket_connect_timeout (seconds) are taken
// too; other redis-py options that do not change what is stored are
// accepted and ignored.
func redisOptions(raw string) (*redis.Options, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return nil, backendURLError("Redis URL %s cannot be read", redactURL(raw))
	}
	scheme := strings.ToLower(u.Scheme)
	opt := &redis.Options{
		DisableIdentity: true,
		// Redis Cloud's maintenance notifications: off, they would start a
		// goroutine per connection for nothing we use.
		MaintNotificationsConfig: &maintnotifications.Config{Mode: maintnotifications.ModeDisabled},
	}
	if u.User != nil {
		opt.Username = u.User.Username()
		opt.Password, _ = u.User.Password()
	}
	q := u.Query()
	db := ""
	switch scheme {
	case "redis+socket", "socket":
		opt.Network = "unix"
		opt.Addr = u.Path
		if opt.Addr == "" {
			return nil, backendURLError("%s:// needs a socket path, as redis+socket:///var/run/redis/redis.sock", scheme)
		}
		db = q.Get("virtual_host")
	default:
		host := u.Hostname()
		if host == "" {
			host = "localhost"
		}
		port := u.Port()
		if port == "" {
			port = "6379"
		}
		opt.Addr = net.JoinHostPort(host, port)
		db = strings.Trim(u.Path, "/")
	}
	if v := q.Get("db"); v != "" {
		db = v
	}
	if db != "" {
		n, err := strconv.Atoi(db)
		if err != nil || n < 0 {
			return nil, backendURLError("Redis database %q is not a number", db)
		}
		opt.DB = n
	}
	if v := q.Get("password"); v != "" {
		opt.Password = v
	}
	for _, k := range []string{"socket_timeout", "socket_connect_timeout"} {
		v := q.Get(k)
		if v == "" {
			continue
		}
		s, err := strconv.ParseFloat(v, 64)
		if err != nil || s <= 0 {
			return nil, backendURLError("Redis %s %q is not a positive number of seconds", k, v)
		}
		d := time.Duration(s * float64(time.Second))
		if k == "socket_timeout" {
			opt.ReadTimeout, opt.WriteTimeout = d, d
		} else {
			opt.DialTimeout = d
		}
	}
	tlsKeys := []string{"ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile"}
	if scheme == "rediss" {
		tc, err := redisTLS(q, u.Hostname())
		if err != nil {
			return nil, err
		}
		opt.TLSConfig = tc
	} else {
		for _, k := range tlsKeys {
			if q.Has(k) {
				// As Celery: SSL parameters need rediss://.
				return nil, backendURLError("Redis URL with %s needs the rediss:// scheme", k)
			}
		}
	}
	known := map[string]bool{"db": true, "virtual_host": true, "password": true, "socket_timeout": true,
		"socket_connect_timeout": true, "ssl_cert_reqs": true, "ssl_ca_certs": true, "ssl_certfile": true,
		"ssl_keyfile": true, "socket_keepalive": true, "retry_on_timeout": true, "health_check_interval": true,
		"max_connections": true, "client_name": true}
	for k := range q {
		if !known[k] {
			return nil, backendURLError("Redis URL option %q is not supported", k)
		}
	}
	return opt, nil
}

// redisTLS is the TLS configuration of a rediss:// URL, from Celery's
// query options: ssl_cert_reqs (required, the default; optional; none),
// ssl_ca_certs (a PEM file of CAs), ssl_certfile and ssl_keyfile (a client
// certificate).
func redisTLS(q url.Values, host string) (*tls.Config, error) {
	tc := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: host}
	switch strings.ToLower(q.Get("ssl_cert_reqs")) {
	case "", "required", "cert_required":
	case "optional", "cert_optional":
		// Python verifies a certificate the server presents; a Redis
		// server always presents one.
	case "none", "cert_none":
		tc.InsecureSkipVerify = true // the URL asks for no verification
	default:
		return nil, backendURLError("Redis ssl_cert_reqs %q: use required, optional or none", q.Get("ssl_cert_reqs"))
	}
	if f := q.Get("ssl_ca_certs"); f != "" {
		pem, err := os.ReadFile(f)
		if err != nil {
			return nil, fmt.Errorf("tasks: %w: read ssl_ca_certs: %w", ErrBackendURL, err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("tasks: %w: ssl_ca_certs %s holds no PEM certificate", ErrBackendURL, f)
		}
		tc.RootCAs = pool
	}
	cf, kf := q.Get("ssl_certfile"), q.Get("ssl_keyfile")
	if cf != "" || kf != "" {
		if kf == "" {
			kf = cf
		}
		cert, err := tls.LoadX509KeyPair(cf, kf)
		if err != nil {
			return nil, fmt.Errorf("tasks: %w: ssl_certfile/ssl_keyfile: %w", ErrBackendURL, err)
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}

func (b *redisBackend) put(ctx context.Context, taskID string, meta []byte) error {
	limit := b.maxValue.Load()
	if limit <= 0 {
		limit = maxRedisValue
	}
	if int64(len(meta)) > limit {
		return fmt.Errorf("%w: %d bytes, the server takes at most %d", errValueTooLarge, len(meta), limit)
	}
	err := storeMeta.Run(ctx, b.c, []string{TaskKeyPrefix + taskID}, meta, b.expires).Err()
	if err != nil {
		return fmt.Errorf("redis store %s: %w", TaskKeyPrefix+clip.String(taskID, maxLogField), err)
	}
	return nil
}

var errValueTooLarge = errors.New("result too large for the Redis backend")

// permanent: the value is too large, or the key holds something that is
// not a string (WRONGTYPE): no retry changes that.
func (b *redisBackend) permanent(err error) bool {
	if errors.Is(err, errValueTooLarge) {
		return true
	}
	// WRONGTYPE: the key holds another type; a value over the server's
	// proto-max-bulk-len: refused the same every time.
	var re redis.Error
	return errors.As(err, &re) && (strings.HasPrefix(re.Error(), "WRONGTYPE") || strings.Contains(re.Error(), "invalid bulk length"))
}

// ping checks the server and reads its proto-max-bulk-len (a server that
// refuses CONFIG keeps the limit as it was).
func (b *redisBackend) ping(ctx context.Context) error {
	if err := b.c.Ping(ctx).Err(); err != nil {
		return err
	}
	if v, err := b.c.ConfigGet(ctx, "proto-max-bulk-len").Result(); err == nil {
		if n, err := strconv.ParseInt(v["proto-max-bulk-len"], 10, 64); err == nil && n > 0 {
			b.maxValue.Store(min(n, maxRedisValue))
		}
	}
	return nil
}

func (b *redisBackend) close() error { return b.c.Close() }

func (b *redisBackend) String() string { return b.url }
