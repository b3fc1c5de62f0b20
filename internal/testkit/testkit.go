// Package testkit is the part of the test environment that starts nothing
// and needs no container engine: it finds the RabbitMQ broker and the
// PostgreSQL database already running (an environment variable, else the
// local default), makes unique names and task ids, polls conditions and
// inspects the broker. The replay suite (integration/replay), which users
// build into tests of their own, depends on this package only;
// internal/testenv adds containers (dockertest) for the project's tests.
package testkit

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"net/url"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/onceler/onceler/internal/uuid"
)

const (
	// DefaultAMQPURL is the broker tried when no URL is configured.
	DefaultAMQPURL = "amqp://guest:guest@127.0.0.1:5672/"
	// DefaultDatabaseURL is the database tried when no URL is configured.
	DefaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
)

// Required reports whether missing services must fail tests rather than
// skip them (ONCELER_REQUIRE_SERVICES=1, as CI sets it).
func Required() bool { return os.Getenv("ONCELER_REQUIRE_SERVICES") == "1" }

// Unavailable skips tb because something it needs is missing (a tool such
// as rabbitmqctl, a TCP connection to the database), or fails it when
// services are required (ONCELER_REQUIRE_SERVICES=1), as in CI, so that
// nothing is skipped there unseen.
func Unavailable(tb testing.TB, format string, args ...any) {
	tb.Helper()
	if Required() {
		tb.Fatalf("required (ONCELER_REQUIRE_SERVICES=1) but unavailable: "+format, args...)
	}
	tb.Skipf(format, args...)
}

// A Service is a server the tests need, looked for once per process: the
// URL in the environment variable Env (which must answer), else Default
// when it answers, else what Start returns (nil: nothing more).
type Service struct {
	What, Env, Default string
	Start              func() (string, error)

	once sync.Once
	url  string
	err  error
}

// URL returns the service's URL, or skips tb (fails it when services are
// required).
func (s *Service) URL(tb testing.TB) string {
	tb.Helper()
	s.once.Do(func() { s.url, s.err = s.locate() })
	if s.err != nil {
		if Required() {
			tb.Fatalf("%s is required (ONCELER_REQUIRE_SERVICES=1) but not available: %v", s.What, s.err)
		}
		tb.Skipf("%s not available: %v", s.What, s.err)
	}
	return s.url
}

func (s *Service) locate() (string, error) {
	if u := os.Getenv(s.Env); u != "" {
		if err := Dial(u); err != nil {
			return "", fmt.Errorf("%s is set but does not answer: %w", s.Env, err)
		}
		return u, nil
	}
	err := Dial(s.Default)
	if err == nil {
		return s.Default, nil
	}
	if s.Start == nil {
		return "", fmt.Errorf("%s is not set and %s does not answer: %w", s.Env, s.Default, err)
	}
	u, err := s.Start()
	if err != nil {
		return "", fmt.Errorf("no local service and no container: %w", err)
	}
	return u, nil
}

// Dial reports whether something listens at the URL's host and port (the
// scheme's default port when it names none): nil when it does.
func Dial(raw string) error {
	u, err := url.Parse(raw)
	if err != nil {
		return fmt.Errorf("parse url: %w", err)
	}
	host := u.Host
	if u.Port() == "" {
		switch u.Scheme {
		case "amqp":
			host = net.JoinHostPort(u.Hostname(), "5672")
		case "amqps":
			host = net.JoinHostPort(u.Hostname(), "5671")
		default:
			host = net.JoinHostPort(u.Hostname(), "5432")
		}
	}
	c, err := net.DialTimeout("tcp", host, 2*time.Second)
	if err != nil {
		return err
	}
	return c.Close()
}

// Rabbit and Postgres are the broker and the database the tests look for,
// each once per process (Rabbit.URL, Postgres.URL): no container is started
// here; internal/testenv adds that with Starting.
var (
	Rabbit   = &Service{What: "RabbitMQ", Env: "ONCELER_TEST_AMQP_URL", Default: DefaultAMQPURL}
	Postgres = &Service{What: "PostgreSQL", Env: "ONCELER_TEST_DATABASE_URL", Default: DefaultDatabaseURL}
)

// Starting returns a service like s, looked for on its own, that runs
// start when neither Env nor Default answers.
func (s *Service) Starting(start func() (string, error)) *Service {
	return &Service{What: s.What, Env: s.Env, Default: s.Default, Start: start}
}

// Name returns a unique lower-case identifier with the given prefix, safe
// for queue, exchange and schema names.
func Name(prefix string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return strings.ToLower(prefix) + "_" + hex.EncodeToString(b[:])
}

// NewID returns a new task id (a random version 4 UUID, as Celery makes).
func NewID() string { return uuid.New() }

// RedisAddr returns the Redis of the tests, ONCELER_TEST_REDIS_ADDR, else
// 127.0.0.1:6379, when it answers; otherwise it skips tb (fails it when
// services are required).
func RedisAddr(tb testing.TB) string {
	tb.Helper()
	addr := os.Getenv("ONCELER_TEST_REDIS_ADDR")
	if addr == "" {
		addr = "127.0.0.1:6379"
	}
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		Unavailable(tb, "Redis not available at %s: %v", addr, err)
	}
	_ = c.Close()
	return addr
}
