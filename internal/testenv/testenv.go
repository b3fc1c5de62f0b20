// Package testenv finds the RabbitMQ broker and PostgreSQL database that
// integration tests run against.
//
// The order is: the ONCELER_TEST_AMQP_URL / ONCELER_TEST_DATABASE_URL
// environment variables; the local defaults when they answer; containers
// started with dockertest when a Docker engine answers; otherwise the test is
// skipped, or fails when ONCELER_REQUIRE_SERVICES=1 (as CI sets it).
package testenv

import (
	"context"
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

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/ory/dockertest/v3"
)

const (
	// DefaultAMQPURL is the broker the tests try when no URL is configured.
	DefaultAMQPURL = "amqp://guest:guest@127.0.0.1:5672/"
	// DefaultDatabaseURL is the database the tests try when no URL is configured.
	DefaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
)

// Required reports whether missing services must fail tests rather than skip them.
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

type found struct {
	once sync.Once
	url  string
	err  error
}

var (
	amqpFound found
	pgFound   found
	dockerMu  sync.Mutex
	pool      *dockertest.Pool
)

// AMQPURL returns a URL of a running RabbitMQ broker, or skips (fails when
// services are required) the test.
func AMQPURL(tb testing.TB) string {
	tb.Helper()
	amqpFound.once.Do(func() {
		amqpFound.url, amqpFound.err = locate("ONCELER_TEST_AMQP_URL", DefaultAMQPURL, startRabbit)
	})
	return use(tb, "RabbitMQ", &amqpFound)
}

// DatabaseURL returns a URL of a running PostgreSQL database, or skips (fails
// when services are required) the test.
func DatabaseURL(tb testing.TB) string {
	tb.Helper()
	pgFound.once.Do(func() {
		pgFound.url, pgFound.err = locate("ONCELER_TEST_DATABASE_URL", DefaultDatabaseURL, startPostgres)
	})
	return use(tb, "PostgreSQL", &pgFound)
}

func use(tb testing.TB, what string, f *found) string {
	tb.Helper()
	if f.err != nil {
		if Required() {
			tb.Fatalf("%s is required (ONCELER_REQUIRE_SERVICES=1) but not available: %v", what, f.err)
		}
		tb.Skipf("%s not available: %v", what, f.err)
	}
	return f.url
}

func locate(env, def string, start func() (string, error)) (string, error) {
	if u := os.Getenv(env); u != "" {
		if err := dialURL(u); err != nil {
			return "", fmt.Errorf("%s is set but does not answer: %w", env, err)
		}
		return u, nil
	}
	if err := dialURL(def); err == nil {
		return def, nil
	}
	u, err := start()
	if err != nil {
		return "", fmt.Errorf("no local service and no container: %w", err)
	}
	return u, nil
}

func dialURL(raw string) error {
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

func docker() (*dockertest.Pool, error) {
	dockerMu.Lock()
	defer dockerMu.Unlock()
	if pool != nil {
		return pool, nil
	}
	p, err := dockertest.NewPool("")
	if err != nil {
		return nil, fmt.Errorf("docker: %w", err)
	}
	if err := p.Client.Ping(); err != nil {
		return nil, fmt.Errorf("docker engine does not answer: %w", err)
	}
	p.MaxWait = 90 * time.Second
	pool = p
	return p, nil
}

func startRabbit() (string, error) {
	p, err := docker()
	if err != nil {
		return "", err
	}
	r, err := p.Run("rabbitmq", "3.10-management", nil)
	if err != nil {
		return "", fmt.Errorf("start rabbitmq container: %w", err)
	}
	_ = r.Expire(600)
	u := fmt.Sprintf("amqp://guest:guest@127.0.0.1:%s/", r.GetPort("5672/tcp"))
	if err := p.Retry(func() error { return dialURL(u) }); err != nil {
		return "", fmt.Errorf("rabbitmq container never answered: %w", err)
	}
	return u, nil
}

func startPostgres() (string, error) {
	p, err := docker()
	if err != nil {
		return "", err
	}
	r, err := p.Run("postgres", "15", []string{"POSTGRES_HOST_AUTH_METHOD=trust", "POSTGRES_DB=test"})
	if err != nil {
		return "", fmt.Errorf("start postgres container: %w", err)
	}
	_ = r.Expire(600)
	u := fmt.Sprintf("postgres://postgres@127.0.0.1:%s/test?sslmode=disable", r.GetPort("5432/tcp"))
	err = p.Retry(func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		c, err := pgx.Connect(ctx, u)
		if err != nil {
			return err
		}
		return c.Close(ctx)
	})
	if err != nil {
		return "", fmt.Errorf("postgres container never answered: %w", err)
	}
	return u, nil
}

// Name returns a unique lower-case identifier with the given prefix, safe for
// queue, exchange and schema names.
func Name(prefix string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return strings.ToLower(prefix) + "_" + hex.EncodeToString(b[:])
}

// Pool returns a pgx pool on the test database, closed when the test ends.
func Pool(tb testing.TB) *pgxpool.Pool {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	p, err := pgxpool.New(ctx, DatabaseURL(tb))
	if err != nil {
		tb.Fatalf("open pool: %v", err)
	}
	tb.Cleanup(p.Close)
	return p
}

// Schema creates a fresh schema for the test and drops it when the test ends.
func Schema(tb testing.TB, p *pgxpool.Pool) string {
	tb.Helper()
	name := Name("t")
	ctx := context.Background()
	if _, err := p.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{name}.Sanitize()); err != nil {
		tb.Fatalf("create schema: %v", err)
	}
	tb.Cleanup(func() {
		_, _ = p.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{name}.Sanitize()+" CASCADE")
	})
	return name
}

// Python returns the path of the system Python that has Celery installed, or
// skips (fails when services are required) the test.
func Python(tb testing.TB) string {
	tb.Helper()
	const py = "/usr/bin/python3"
	if _, err := os.Stat("/usr/lib/python3/dist-packages/celery/__init__.py"); err != nil {
		if Required() {
			tb.Fatalf("python3-celery is required (ONCELER_REQUIRE_SERVICES=1) but not installed")
		}
		tb.Skip("python3-celery not installed")
	}
	return py
}
