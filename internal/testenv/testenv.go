// Package testenv finds the RabbitMQ broker and PostgreSQL database that
// the project's integration tests run against.
//
// The order is: the ONCELER_TEST_AMQP_URL / ONCELER_TEST_DATABASE_URL
// environment variables; the local defaults when they answer; containers
// started with dockertest when a Docker engine answers; otherwise the test is
// skipped, or fails when ONCELER_REQUIRE_SERVICES=1 (as CI sets it). The
// part that starts nothing is internal/testkit, which the replay suite uses
// so that its users' builds do not compile dockertest.
package testenv

import (
	"context"
	"fmt"
	"net"
	neturl "net/url"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/ory/dockertest/v3"

	"github.com/onceler/onceler/internal/testkit"
)

const (
	// DefaultAMQPURL is the broker the tests try when no URL is configured.
	DefaultAMQPURL = testkit.DefaultAMQPURL
	// DefaultDatabaseURL is the database the tests try when no URL is configured.
	DefaultDatabaseURL = testkit.DefaultDatabaseURL
)

// Required reports whether missing services must fail tests rather than
// skip them (testkit.Required).
func Required() bool { return testkit.Required() }

// Unavailable skips tb, or fails it when services are required
// (testkit.Unavailable).
func Unavailable(tb testing.TB, format string, args ...any) {
	tb.Helper()
	testkit.Unavailable(tb, format, args...)
}

var (
	rabbit   = testkit.Rabbit.Starting(startRabbit)
	postgres = testkit.Postgres.Starting(startPostgres)
	dockerMu sync.Mutex
	pool     *dockertest.Pool
)

// AMQPURL returns a URL of a running RabbitMQ broker, or skips (fails when
// services are required) the test.
func AMQPURL(tb testing.TB) string {
	tb.Helper()
	return rabbit.URL(tb)
}

// DatabaseURL returns a URL of a running PostgreSQL database, or skips (fails
// when services are required) the test.
func DatabaseURL(tb testing.TB) string {
	tb.Helper()
	return postgres.URL(tb)
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
	if err := p.Retry(func() error { return testkit.Dial(u) }); err != nil {
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

// Name returns a unique lower-case identifier with the given prefix, safe
// for queue, exchange and schema names (testkit.Name).
func Name(prefix string) string { return testkit.Name(prefix) }

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

// Role creates a PostgreSQL role of its own for the test (LOGIN, not a
// superuser, no privileges beyond PUBLIC's) and returns its name and the
// test database's URL with that role as the user. When the test ends its
// privileges are revoked (DROP OWNED) and it is dropped.
func Role(tb testing.TB, p *pgxpool.Pool) (name, url string) {
	tb.Helper()
	name = Name("r")
	ctx := context.Background()
	id := pgx.Identifier{name}.Sanitize()
	if _, err := p.Exec(ctx, "CREATE ROLE "+id+" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE"); err != nil {
		tb.Fatalf("create role: %v", err)
	}
	tb.Cleanup(func() {
		// Concurrent changes of one object's privileges (tests granting
		// on the same shared tables) may fail with "tuple concurrently
		// updated": try again.
		for range 20 {
			if _, err := p.Exec(context.Background(), "DROP OWNED BY "+id); err == nil {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		_, _ = p.Exec(context.Background(), "DROP ROLE "+id)
	})
	cfg := p.Config().ConnConfig
	u := neturl.URL{Scheme: "postgres", User: neturl.User(name), Host: net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))),
		Path: "/" + cfg.Database, RawQuery: "sslmode=disable"}
	return name, u.String()
}

// Grant runs the GRANT (or REVOKE) statement q on p, again while it fails
// because a concurrent test changed the same object's privileges ("tuple
// concurrently updated").
func Grant(tb testing.TB, p *pgxpool.Pool, q string) {
	tb.Helper()
	var err error
	for range 20 {
		if _, err = p.Exec(context.Background(), q); err == nil {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	tb.Fatalf("%s: %v", q, err)
}
