package amqp

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

func assertNoSecret(t *testing.T, s, secret string) {
	t.Helper()
	if strings.Contains(s, secret) {
		t.Fatalf("secret leaked: %s", s)
	}
}

func TestRedactURL(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"amqp://guest:guest@localhost:5672//":         "amqp://guest:xxxxx@localhost:5672//",
		"amqps://u:p%40ss@broker/vh?heartbeat=5":      "amqps://u:xxxxx@broker/vh?heartbeat=5",
		"pyamqp://user@host//":                        "pyamqp://user@host//",
		"amqp://host":                                 "amqp://host",
		"amqp://u:pa ss@ho st:bad/":                   "<unparsable URL>",
		"not a url at all, password=hunter2:@x/%%":    "<unparsable URL>",
		"amqp:guest:hunter2@host:9999/vh":             "<unparsable URL>",
		"amqp:/guest:hunter2@127.0.0.1:5673//":        "<unparsable URL>",
		"guest:hunter2@127.0.0.1":                     "<unparsable URL>",
		"amqp://a:hunter2@h1//;amqp://b:hunter2@h2//": "amqp://a:xxxxx@h1//;amqp://b:xxxxx@h2//",
	} {
		if got := RedactURL(in); got != want {
			t.Errorf("RedactURL(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestNormalizeCeleryURLs(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]struct{ scheme, host, vhost string }{
		"amqp://guest:guest@localhost:5672//": {"amqp", "localhost", "/"},
		"amqp://guest:guest@localhost:5672/":  {"amqp", "localhost", "/"},
		"amqp://guest:guest@localhost:5672":   {"amqp", "localhost", "/"},
		"pyamqp://guest@broker//":             {"amqp", "broker", "/"},
		"amqp://h/%2f":                        {"amqp", "h", "/"},
		"amqp://h/orders":                     {"amqp", "h", "orders"},
		"amqps://h:5671//":                    {"amqps", "h", "/"},
		"pyamqps://h//":                       {"amqps", "h", "/"},
	} {
		_, uri, err := normalizeURL(in)
		if err != nil {
			t.Errorf("normalizeURL(%q): %v", in, err)
			continue
		}
		if uri.Scheme != want.scheme || uri.Host != want.host || uri.Vhost != want.vhost {
			t.Errorf("normalizeURL(%q) = %s %s %q, want %+v", in, uri.Scheme, uri.Host, uri.Vhost, want)
		}
	}
	for _, bad := range []string{"", "redis://h//", "amqp://u:pw%zz@h/", "amqp:u:pw%zz@h:9999/vh", "amqp:/u:pw%zz@h//",
		"u:pw%zz@h", "amqp://u:pw%zz@h1//;amqp://u:pw%zz@h2//"} {
		_, _, err := normalizeURL(bad)
		if !errors.Is(err, ErrConfig) {
			t.Errorf("normalizeURL(%q) = %v, want ErrConfig", bad, err)
		}
		if err != nil {
			assertNoSecret(t, err.Error(), "pw%zz")
		}
	}
}

func TestTLSConfigErrors(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	notPEM := filepath.Join(dir, "ca.pem")
	must(t, os.WriteFile(notPEM, []byte("not a certificate"), 0o600), "write")
	cases := []Config{
		{URL: "amqp://h//", TLS: TLSConfig{CAFile: notPEM}},                      // TLS files on a plain URL
		{URL: "amqps://h//", TLS: TLSConfig{CAFile: filepath.Join(dir, "none")}}, // unreadable
		{URL: "amqps://h//", TLS: TLSConfig{CAFile: notPEM}},                     // no PEM in it
		{URL: "amqps://h//", TLS: TLSConfig{CertFile: notPEM}},                   // cert without key
		{URL: "amqps://h//", TLS: TLSConfig{CertFile: notPEM, KeyFile: notPEM}},  // bad pair
	}
	for i, c := range cases {
		_, _, err := newFailover(c.withDefaults(), zap.NewNop()).dial(context.Background(), "test")
		if !errors.Is(err, ErrConfig) {
			t.Errorf("case %d: dial = %v, want ErrConfig", i, err)
		}
	}
	// A consumer with a bad Config stops at once instead of retrying forever.
	c := NewConsumer(cases[0], ConsumerConfig{Queues: []QueueSpec{CeleryQueue("q")}})
	if err := c.Run(ctxTimeout(t, 5*time.Second), func(*Delivery) {}); !errors.Is(err, ErrConfig) {
		t.Fatalf("Run with TLS files on amqp:// = %v, want ErrConfig", err)
	}
}

// Wrong credentials: the consumer keeps retrying with backoff, a publisher
// that never connected fails at once with ErrAccessRefused, and neither
// logs nor errors show the password.
func TestPasswordNeverLogged(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t)
	good := testenv.AMQPURL(t)
	_, uri, err := normalizeURL(good)
	must(t, err, "parse test URL")
	const secret = "n0t-the-Pa55word"
	cfg.URL = "amqp://" + uri.Username + ":" + secret + "@" + uri.Host + ":" + itoa(uri.Port) + "//"
	core, logs := observer.New(zapcore.DebugLevel)
	cfg.Logger = zap.New(core)
	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQueue("unused")}})
	// RabbitMQ answers a bad password after about 3s; stop once the
	// consumer has logged the refusal and the publisher returned it.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	runErr := make(chan error, 1)
	go func() { runErr <- c.Run(ctx, func(*Delivery) {}) }()
	p := NewPublisher(cfg)
	defer p.Close()
	pubErr := make(chan error, 1)
	go func() { pubErr <- p.Publish(ctx, "", "q", textMessage("x"), PublishOptions{}) }()
	lines := func() (all []string, refused map[string]bool) {
		refused = map[string]bool{}
		for _, e := range logs.All() {
			line := e.Message
			for k, v := range e.ContextMap() {
				line += " " + k + "=" + toString(v)
			}
			all = append(all, line)
			if strings.Contains(line, "403") {
				refused[e.LoggerName] = true
			}
		}
		return all, refused
	}
	testkit.WaitFor(t, "the consumer logs the refused login", 18*time.Second, func() bool {
		_, refused := lines()
		return refused["amqp.consumer"]
	})
	if c.Ready() {
		t.Fatal("Ready with a wrong password")
	}
	var perr error
	select {
	case perr = <-pubErr:
	case <-time.After(10 * time.Second):
		t.Fatal("publish with a wrong password still retrying")
	}
	cancel()
	must(t, <-runErr, "Run")
	if !errors.Is(perr, ErrAccessRefused) || !strings.Contains(perr.Error(), "403") {
		t.Fatalf("publish with a wrong password = %v, want ErrAccessRefused with the broker's 403", perr)
	}
	assertNoSecret(t, perr.Error(), secret)
	all, _ := lines()
	for _, line := range all {
		assertNoSecret(t, line, secret)
	}
}

func itoa(n int) string { return strconv.Itoa(n) }

func toString(v any) string {
	if err, ok := v.(error); ok {
		return err.Error()
	}
	if s, ok := v.(string); ok {
		return s
	}
	return ""
}

func TestBackoffJitterBounds(t *testing.T) {
	t.Parallel()
	b := backoff{min: 100 * time.Millisecond, max: time.Second}
	wants := []time.Duration{100, 200, 400, 800, 1000, 1000}
	for i, w := range wants {
		w *= time.Millisecond
		d := b.next()
		if d < w/2 || d >= w {
			t.Fatalf("attempt %d: wait %v outside [%v, %v)", i, d, w/2, w)
		}
	}
	b.reset()
	if d := b.next(); d >= 100*time.Millisecond {
		t.Fatalf("after reset: %v", d)
	}
}
