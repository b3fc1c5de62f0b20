package amqp

import (
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/onceler/onceler/internal/testenv"
)

func TestURLListParsing(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		cfg   Config
		hosts []string
	}{
		{Config{URL: "amqp://a//"}, []string{"a"}},
		{Config{URL: "amqp://u:pw@a:5672//;amqp://u:pw@b:5673//"}, []string{"a", "b"}},
		{Config{URL: "  amqp://a// ;; ; pyamqp://b// ;"}, []string{"a", "b"}}, // blanks and empty elements
		{Config{URLs: []string{"amqp://a//", " ", "amqp://b//;amqp://c//"}}, []string{"a", "b", "c"}},
		{Config{URL: "amqps://a//;amqp://b//;pyamqps://c//"}, []string{"a", "b", "c"}}, // amqps mixed with amqp
	} {
		eps, err := c.cfg.endpoints()
		if err != nil {
			t.Errorf("%+v: %v", c.cfg, err)
			continue
		}
		var hosts []string
		for _, e := range eps {
			hosts = append(hosts, e.uri.Host)
		}
		if strings.Join(hosts, ",") != strings.Join(c.hosts, ",") {
			t.Errorf("%q %q: hosts %v, want %v", c.cfg.URL, c.cfg.URLs, hosts, c.hosts)
		}
	}
	mixed, err := Config{URL: "amqps://a//;amqp://b//"}.endpoints()
	if err != nil || mixed[0].uri.Scheme != "amqps" || mixed[1].uri.Scheme != "amqp" {
		t.Fatalf("mixed list: %+v %v", mixed, err)
	}
	for _, bad := range []Config{
		{URL: " ; ;"},
		{URLs: []string{"", " "}},
		{URL: "amqp://a//", URLs: []string{"amqp://b//"}},
		{URL: "amqp://a//;amqp://b//", TLS: TLSConfig{ServerName: "a"}}, // TLS with no amqps:// URL
	} {
		if _, err := bad.endpoints(); !errors.Is(err, ErrConfig) {
			t.Errorf("%+v: %v, want ErrConfig", bad, err)
		}
	}
	// A bad URL is named (redacted) with its place in the list.
	const secret = "hunter2-list"
	_, err = Config{URL: "amqp://u:" + secret + "@a//;redis://u:" + secret + "@b:6379/0;amqp://c//"}.endpoints()
	if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "URL 2 of the 3") ||
		!strings.Contains(err.Error(), "redis://u:xxxxx@b:6379/0") {
		t.Errorf("bad second URL: %v", err)
	}
	if err != nil {
		assertNoSecret(t, err.Error(), secret)
	}
	_, err = DialURLs("amqp://u:" + secret + "@a//;amqp://u:" + secret + "@b:bad//")
	if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "URL 2 of the 2") {
		t.Errorf("DialURLs: %v", err)
	}
	if err != nil {
		assertNoSecret(t, err.Error(), secret)
	}
	urls, err := DialURLs("pyamqp://a//; amqps://b//")
	if err != nil || len(urls) != 2 || urls[0] != "amqp://a//" || urls[1] != "amqps://b//" {
		t.Errorf("DialURLs = %q, %v", urls, err)
	}
	if got := RedactURL("amqp://u:" + secret + "@a//;amqps://u:" + secret + "@b//"); strings.Contains(got, secret) {
		t.Errorf("RedactURL of a list: %s", got)
	}
}

func TestURLListTLS(t *testing.T) {
	t.Parallel()
	// A mixed list: the TLS settings serve its amqps:// URLs; each is
	// verified as its own host.
	tc, err := Config{URL: "amqp://a//;amqps://b//;amqps://c//", TLS: TLSConfig{CAFile: ""}}.TLSClientConfig()
	if err != nil || tc == nil || tc.ServerName != "" {
		t.Fatalf("TLSClientConfig of a list: %+v, %v; want a config without ServerName", tc, err)
	}
	tc, err = Config{URL: "amqps://b//;amqps://c//", TLS: TLSConfig{ServerName: "broker.internal"}}.TLSClientConfig()
	if err != nil || tc == nil || tc.ServerName != "broker.internal" {
		t.Fatalf("explicit ServerName: %+v, %v", tc, err)
	}
	tc, err = Config{URL: "amqp://a//;amqp://b//"}.TLSClientConfig()
	if err != nil || tc != nil {
		t.Fatalf("plain list: %+v, %v; want nil", tc, err)
	}
	eps, err := Config{URL: "amqp://a//;amqps://b//", TLS: TLSConfig{ServerName: "x"}}.endpoints()
	if err != nil {
		t.Fatal(err)
	}
	c := Config{TLS: TLSConfig{ServerName: "x"}}
	if tc, err := c.tlsConfig(eps[0].uri); tc != nil || err != nil {
		t.Errorf("amqp:// URL of a mixed list dials with TLS: %+v %v", tc, err)
	}
	if tc, err := c.tlsConfig(eps[1].uri); tc == nil || err != nil {
		t.Errorf("amqps:// URL of a mixed list dials without TLS: %v", err)
	}
}

// The next attempt after a failure goes to the URL after the failed one,
// round robin; a failure reported twice (two connections to one URL lost)
// moves on once.
func TestFailoverRoundRobin(t *testing.T) {
	t.Parallel()
	core, logs := observer.New(zapcore.WarnLevel)
	f := newFailover(Config{URL: "amqp://u:s3cr3t@a//;amqp://u:s3cr3t@b//;amqp://u:s3cr3t@c//"}, zap.New(core))
	if f.err != nil {
		t.Fatal(f.err)
	}
	var seen []string
	for range 5 {
		i := f.current()
		seen = append(seen, f.eps[i].uri.Host)
		f.failed(i)
		f.failed(i)
	}
	if got := strings.Join(seen, ""); got != "abcab" {
		t.Fatalf("attempts went to %s, want abcab", got)
	}
	for _, e := range logs.All() {
		for _, fld := range e.Context {
			assertNoSecret(t, fld.String, "s3cr3t")
		}
	}
	if logs.FilterMessageSnippet("next URL").Len() != 5 {
		t.Errorf("%d failover log lines, want 5", logs.Len())
	}
}

// deadURL returns an amqp:// URL with a password where nothing listens.
func deadURL(t *testing.T, password string) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err, "listen")
	addr := l.Addr().String()
	must(t, l.Close(), "close")
	return "amqp://guest:" + password + "@" + addr + "//"
}

// A list whose first URL is down: the consumer and the publisher connect to
// the next; the logs name the dead one, redacted.
func TestFailoverToSecondURL(t *testing.T) {
	t.Parallel()
	const secret = "dead-n0de-pw"
	core, logs := observer.New(zapcore.DebugLevel)
	cfg := testConfig(t)
	cfg.Logger = zap.New(core)
	cfg.URL = deadURL(t, secret) + " ; " + testenv.AMQPURL(t)
	q := testenv.Name("onceler_amqp_failover")
	cleanupQueue(t, q)
	p := newPublisher(t, cfg)
	ctx := ctxTimeout(t, 30*time.Second)
	must(t, p.Declare(ctx, CeleryQueue(q)), "declare over the second URL")
	must(t, p.Publish(ctx, "", q, textMessage("over the second"), PublishOptions{Mandatory: true}), "publish")
	got := make(chan *Delivery, 1)
	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQueue(q)}})
	stop := runConsumer(t, c, func(d *Delivery) { got <- d })
	d := recv(t, got, 20*time.Second)
	must(t, d.Ack(), "ack")
	must(t, stop(), "stop")
	if logs.FilterMessageSnippet("next URL").Len() < 2 {
		t.Errorf("want a failover line from the consumer and the publisher, got %d", logs.FilterMessageSnippet("next URL").Len())
	}
	for _, e := range logs.All() {
		assertNoSecret(t, e.Message, secret)
		for _, fld := range e.Context {
			assertNoSecret(t, fld.String, secret)
			if fld.Interface != nil {
				if err, ok := fld.Interface.(error); ok {
					assertNoSecret(t, err.Error(), secret)
				}
			}
		}
	}
}
