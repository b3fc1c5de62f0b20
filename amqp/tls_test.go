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

func TestTLSWithClientCertificate(t *testing.T) {
	base := testConfig(t)
	_, uri, err := normalizeURL(base.URL)
	must(t, err, "parse")
	pki := newTestPKI(t)
	addr := tlsProxy(t, pki, net.JoinHostPort(uri.Host, strconv.Itoa(uri.Port)))
	_, port, _ := net.SplitHostPort(addr)
	u := url.URL{Scheme: "amqps", User: url.UserPassword(uri.Username, uri.Password), Host: "localhost:" + port, Path: "//"}

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
