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
	"github.com/onceler/onceler/internal/testkit"
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

// A publisher whose connection is lost, with every URL of a two-URL list
// down, tries both in turn: a lost session moves the rotation on once.
func TestPublisherFailoverAlternates(t *testing.T) {
	t.Parallel()
	core, logs := observer.New(zapcore.DebugLevel)
	cfg := testConfig(t)
	cfg.Logger = zap.New(core)
	a, b := deadURL(t, "pw"), deadURL(t, "pw")
	cfg.URL = a + ";" + b
	p := newPublisher(t, cfg)
	ctx := ctxTimeout(t, 2*time.Second)
	err := p.Publish(ctx, "", "nowhere", textMessage("x"), PublishOptions{})
	if err == nil {
		t.Fatal("publish with every URL down succeeded")
	}
	var hosts []string
	for _, e := range logs.FilterMessageSnippet("next URL").All() {
		for _, f := range e.Context {
			if f.Key == "failed" {
				_, rest, _ := strings.Cut(f.String, "@")
				hosts = append(hosts, strings.TrimSuffix(rest, "//"))
			}
		}
	}
	if len(hosts) < 4 {
		t.Fatalf("attempts %v, want at least 4", hosts)
	}
	for i, h := range hosts {
		if want := []string{a, b}[i%2]; !strings.Contains(want, h) {
			t.Fatalf("attempt %d went to %s, want alternating %s and %s: %v", i, h, a, b, hosts)
		}
	}
}

// A publisher on the first URL of [live, dead] whose connection the broker
// closes tries the dead URL, then the live one again, and publishes: a
// lost session moves the rotation on once, not at every retry.
func TestPublisherFailoverBackToLiveURL(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t)
	cfg.URL = testenv.AMQPURL(t) + ";" + deadURL(t, "pw")
	q := testenv.Name("onceler_amqp_failback")
	cleanupQueue(t, q)
	p := newPublisher(t, cfg)
	ctx := ctxTimeout(t, 30*time.Second)
	must(t, p.Declare(ctx, CeleryQueue(q)), "declare")
	must(t, p.Publish(ctx, "", q, textMessage("one"), PublishOptions{Mandatory: true}), "publish")
	pids := testkit.ConnectionPIDs(t, cfg.Name)
	if len(pids) == 0 {
		t.Fatal("the publisher's connection is not listed")
	}
	testkit.CloseConnections(t, pids)
	ctx2 := ctxTimeout(t, 10*time.Second)
	must(t, p.Publish(ctx2, "", q, textMessage("two"), PublishOptions{Mandatory: true}), "publish after the connection was closed")
	if d := testkit.QueueDepth(t, testenv.AMQPURL(t), q); d != 2 {
		t.Fatalf("queue depth %d, want 2", d)
	}
}
