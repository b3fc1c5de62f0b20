package amqp

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"io"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	amqp091 "github.com/onceler/onceler/internal/amqp091"
	"github.com/onceler/onceler/internal/testenv"
)

type testPKI struct {
	caFile, certFile, keyFile string
	serverCert                tls.Certificate
	caPool                    *x509.CertPool
}

func newTestPKI(t *testing.T) testPKI {
	t.Helper()
	dir := t.TempDir()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	must(t, err, "ca key")
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "onceler test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	must(t, err, "ca cert")
	caCert, err := x509.ParseCertificate(caDER)
	must(t, err, "parse ca")
	issue := func(serial int64, usage x509.ExtKeyUsage) ([]byte, *ecdsa.PrivateKey) {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		must(t, err, "key")
		tmpl := &x509.Certificate{
			SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: "localhost"},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
			DNSNames: []string{"localhost"}, IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
			KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage},
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
		must(t, err, "cert")
		return der, key
	}
	writePEM := func(name, typ string, der []byte) string {
		p := filepath.Join(dir, name)
		must(t, os.WriteFile(p, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600), "write %s", name)
		return p
	}
	pki := testPKI{caFile: writePEM("ca.pem", "CERTIFICATE", caDER), caPool: x509.NewCertPool()}
	pki.caPool.AddCert(caCert)
	sDER, sKey := issue(2, x509.ExtKeyUsageServerAuth)
	pki.serverCert = tls.Certificate{Certificate: [][]byte{sDER}, PrivateKey: sKey}
	cDER, cKey := issue(3, x509.ExtKeyUsageClientAuth)
	cKeyDER, err := x509.MarshalECPrivateKey(cKey)
	must(t, err, "marshal key")
	pki.certFile = writePEM("client.pem", "CERTIFICATE", cDER)
	pki.keyFile = writePEM("client-key.pem", "EC PRIVATE KEY", cKeyDER)
	return pki
}

// tlsProxy terminates TLS (client certificate required) on a loopback port
// and forwards to the plain-text test broker, standing in for a TLS broker.
func tlsProxy(t *testing.T, pki testPKI, upstream string) string {
	t.Helper()
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{
		Certificates: []tls.Certificate{pki.serverCert},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    pki.caPool,
		MinVersion:   tls.VersionTLS12,
	})
	must(t, err, "listen")
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	track := func(c net.Conn) {
		mu.Lock()
		conns = append(conns, c)
		mu.Unlock()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			track(c)
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				if err := c.(*tls.Conn).Handshake(); err != nil {
					return
				}
				up, err := net.Dial("tcp", upstream)
				if err != nil {
					return
				}
				track(up)
				defer up.Close()
				done := make(chan struct{}, 2)
				go func() { _, _ = io.Copy(up, c); done <- struct{}{} }()
				go func() { _, _ = io.Copy(c, up); done <- struct{}{} }()
				<-done
				_ = c.Close()
				_ = up.Close()
				<-done
			}()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return ln.Addr().String()
}

// proxiedBroker starts a TLS proxy (client certificate required) in front of
// the test broker and returns its amqps:// URL (vhost "/", host localhost),
// the test broker's configuration and URI.
func proxiedBroker(t *testing.T, pki testPKI) (url.URL, Config, amqp091.URI) {
	t.Helper()
	base := testConfig(t)
	_, uri, err := normalizeURL(base.URL)
	must(t, err, "parse")
	addr := tlsProxy(t, pki, net.JoinHostPort(uri.Host, strconv.Itoa(uri.Port)))
	_, port, _ := net.SplitHostPort(addr)
	return url.URL{Scheme: "amqps", User: url.UserPassword(uri.Username, uri.Password), Host: "localhost:" + port}, base, uri
}

func TestTLSWithClientCertificate(t *testing.T) {
	t.Parallel()
	pki := newTestPKI(t)
	u, base, uri := proxiedBroker(t, pki)
	u.Path = "//"

	cfg := base
	cfg.URL = u.String()
	cfg.TLS = TLSConfig{CAFile: pki.caFile, CertFile: pki.certFile, KeyFile: pki.keyFile}
	q := testenv.Name("onceler_amqp_tls")
	cleanupQueue(t, q)
	p := newPublisher(t, cfg)
	ctx := ctxTimeout(t, 30*time.Second)
	must(t, p.Declare(ctx, CeleryQueue(q)), "declare over TLS")
	must(t, p.Publish(ctx, q, q, textMessage(`"secure"`), PublishOptions{Mandatory: true}), "publish over TLS")
	c := NewConsumer(cfg, ConsumerConfig{Queues: []QueueSpec{CeleryQueue(q)}})
	got := make(chan *Delivery, 1)
	stop := runConsumer(t, c, func(d *Delivery) { got <- d })
	d := recv(t, got, 15*time.Second)
	if string(d.Body) != `"secure"` {
		t.Fatalf("body %q", d.Body)
	}
	must(t, d.Ack(), "ack over TLS")
	must(t, stop(), "stop")

	// Without the client certificate, or trusting another CA, no session.
	for name, tc := range map[string]TLSConfig{
		"no client cert": {CAFile: pki.caFile},
		"unknown CA":     {CAFile: newTestPKI(t).caFile, CertFile: pki.certFile, KeyFile: pki.keyFile},
	} {
		bad := cfg
		bad.TLS = tc
		bp := NewPublisher(bad)
		bctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		err := bp.Publish(bctx, "", q, textMessage("x"), PublishOptions{})
		cancel()
		_ = bp.Close()
		if err == nil {
			t.Fatalf("%s: publish succeeded", name)
		}
		assertNoSecret(t, err.Error(), uri.Password+"@")
	}
}

func TestTLSClientConfig(t *testing.T) {
	t.Parallel()
	pki := newTestPKI(t)
	files := TLSConfig{CAFile: pki.caFile, CertFile: pki.certFile, KeyFile: pki.keyFile}

	// Plain amqp:// without files: no TLS.
	tc, err := Config{URL: "amqp://guest:guest@localhost:5672//"}.TLSClientConfig()
	if err != nil || tc != nil {
		t.Fatalf("amqp:// = %v, %v; want nil, nil", tc, err)
	}

	tc, err = Config{URL: "pyamqps://u:p@localhost:5671//", TLS: files}.TLSClientConfig()
	must(t, err, "amqps:// with files")
	if tc.MinVersion != tls.VersionTLS12 || tc.ServerName != "localhost" {
		t.Fatalf("MinVersion %x ServerName %q, want TLS 1.2 and the URL's host", tc.MinVersion, tc.ServerName)
	}
	if len(tc.Certificates) != 1 {
		t.Fatalf("%d client certificates, want 1", len(tc.Certificates))
	}
	client, err := x509.ParseCertificate(tc.Certificates[0].Certificate[0])
	must(t, err, "parse client certificate")
	if _, err := client.Verify(x509.VerifyOptions{Roots: pki.caPool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		t.Fatalf("client certificate is not the one in CertFile: %v", err)
	}
	server, err := x509.ParseCertificate(pki.serverCert.Certificate[0])
	must(t, err, "parse server certificate")
	if _, err := server.Verify(x509.VerifyOptions{Roots: tc.RootCAs, DNSName: "localhost"}); err != nil {
		t.Fatalf("RootCAs do not hold CAFile: %v", err)
	}

	named := files
	named.ServerName = "rabbit.internal"
	tc, err = Config{URL: "amqps://localhost//", TLS: named}.TLSClientConfig()
	must(t, err, "ServerName")
	if tc.ServerName != "rabbit.internal" {
		t.Fatalf("ServerName %q, want the override", tc.ServerName)
	}
	tc, err = Config{URL: "amqps://localhost//"}.TLSClientConfig()
	if err != nil || tc == nil || tc.RootCAs != nil || len(tc.Certificates) != 0 {
		t.Fatalf("amqps:// without files = %+v, %v; want the system roots and no client certificate", tc, err)
	}

	for name, c := range map[string]Config{
		"bad URL":          {URL: "redis://h//"},
		"files on amqp://": {URL: "amqp://h//", TLS: files},
		"cert without key": {URL: "amqps://h//", TLS: TLSConfig{CertFile: pki.certFile}},
		"missing CA":       {URL: "amqps://h//", TLS: TLSConfig{CAFile: filepath.Join(t.TempDir(), "none")}},
	} {
		if tc, err := c.TLSClientConfig(); !errors.Is(err, ErrConfig) || tc != nil {
			t.Errorf("%s: %v, %v; want ErrConfig", name, tc, err)
		}
	}
}

// The exported configuration alone is enough for another amqp091 connection
// (as the control connection makes) to pass a broker that requires the
// client certificate.
func TestTLSClientConfigDialsWithClientCertificate(t *testing.T) {
	t.Parallel()
	pki := newTestPKI(t)
	u, _, _ := proxiedBroker(t, pki)
	dial := func(files TLSConfig) error {
		tc, err := Config{URL: u.String(), TLS: files}.TLSClientConfig()
		if err != nil {
			return err
		}
		conn, err := amqp091.DialConfig(u.String(), amqp091.Config{
			TLSClientConfig: tc,
			Dial:            amqp091.DefaultDial(10 * time.Second),
		})
		if err != nil {
			return err
		}
		ch, err := conn.Channel()
		if err == nil {
			err = ch.Close()
		}
		return errors.Join(err, conn.Close())
	}
	must(t, dial(TLSConfig{CAFile: pki.caFile, CertFile: pki.certFile, KeyFile: pki.keyFile}), "dial with the client certificate")
	if err := dial(TLSConfig{CAFile: pki.caFile}); err == nil {
		t.Fatal("dial without the client certificate succeeded")
	}
}
