package tasks

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/control"
)

// TestControlConfigUsesBrokerTLS: the remote control connection gets the
// worker's broker URL, CA and client certificate, node name, task events
// setting, queues, concurrency and prefetch.
func TestControlConfigUsesBrokerTLS(t *testing.T) {
	t.Parallel()
	certFile, keyFile, cert := writeSelfSigned(t)
	cfg := Config{
		Broker: amqp.Config{URL: "amqps://u:p@rabbit.example:5671//",
			TLS: amqp.TLSConfig{CAFile: certFile, CertFile: certFile, KeyFile: keyFile}},
		Queues:      []amqp.QueueSpec{amqp.CeleryQueue("q1")},
		Concurrency: 3, Prefetch: 7, TaskEvents: true, Hostname: "n@h", Logger: zap.NewNop(),
	}
	if err := cfg.setDefaults(); err != nil {
		t.Fatal(err)
	}
	cc, err := controlConfig(&cfg)
	if err != nil {
		t.Fatal(err)
	}
	if cc.URL != cfg.Broker.URL || cc.NodeName != "n@h" || !cc.TaskEvents || cc.Concurrency != 3 || cc.Prefetch != 7 ||
		cc.RevokedTTL != cfg.RevokedExpiry {
		t.Fatalf("control config %+v", cc)
	}
	if cc.TLS == nil || len(cc.TLS.Certificates) != 1 {
		t.Fatalf("control TLS %+v: want the client certificate", cc.TLS)
	}
	leaf, err := x509.ParseCertificate(cc.TLS.Certificates[0].Certificate[0])
	if err != nil || !leaf.Equal(cert) {
		t.Fatalf("control client certificate is not the broker's CertFile (%v)", err)
	}
	if _, err := cert.Verify(x509.VerifyOptions{Roots: cc.TLS.RootCAs, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		t.Fatalf("control RootCAs do not hold the broker's CAFile: %v", err)
	}
	if cc.TLS.ServerName != "rabbit.example" {
		t.Fatalf("control TLS ServerName %q", cc.TLS.ServerName)
	}

	// Plain amqp://: no TLS; TLS files on it: a configuration error, as for
	// the worker's own connections.
	cfg.Broker = amqp.Config{URL: "amqp://localhost//"}
	if cc, err := controlConfig(&cfg); err != nil || cc.TLS != nil {
		t.Fatalf("amqp:// control config TLS %v, %v", cc.TLS, err)
	}
	cfg.Broker.TLS = amqp.TLSConfig{CertFile: certFile, KeyFile: keyFile}
	if _, err := controlConfig(&cfg); !errors.Is(err, amqp.ErrConfig) {
		t.Fatalf("TLS files on amqp:// = %v, want amqp.ErrConfig", err)
	}
	if _, err := NewWorker(NewRegistry(), cfg); !errors.Is(err, amqp.ErrConfig) {
		t.Fatalf("NewWorker with TLS files on amqp:// = %v, want amqp.ErrConfig", err)
	}
}

// TestNewWorkerDefaults: a worker given only its broker logs (a zap
// logger, not none), runs its remote control under a node name unique per
// process, as the onceler command does; NoControl turns the control off;
// a control.Controller as Observer needs NoControl.
func TestNewWorkerDefaults(t *testing.T) {
	t.Parallel()
	w, err := NewWorker(NewRegistry(), Config{Broker: amqp.Config{URL: "amqp://localhost//"}})
	if err != nil {
		t.Fatal(err)
	}
	if !w.cfg.Logger.Core().Enabled(zapcore.InfoLevel) || w.cfg.Logger.Core().Enabled(zapcore.DebugLevel) {
		t.Error("default logger does not log at info")
	}
	if want := fmt.Sprintf("onceler-%d@", os.Getpid()); !strings.HasPrefix(w.Hostname(), want) {
		t.Errorf("default node name %q, want %s<host>", w.Hostname(), want)
	}
	ctl := w.Controller()
	if ctl == nil || ctl.NodeName() != w.Hostname() || ctl.TaskEvents() {
		t.Fatalf("remote control %v: want one named %s, task events off", ctl, w.Hostname())
	}
	if obs, ok := w.obs.(*control.Controller); !ok || obs != ctl {
		t.Errorf("task events go to %T, want the remote control", w.obs)
	}
	w, err = NewWorker(NewRegistry(), Config{Broker: amqp.Config{URL: "amqp://localhost//"}, NoControl: true, Logger: zap.NewNop()})
	if err != nil || w.Controller() != nil || w.obs != nil {
		t.Fatalf("NoControl: %v, controller %v, observer %v", err, w.Controller(), w.obs)
	}
	_, err = NewWorker(NewRegistry(), Config{Broker: amqp.Config{URL: "amqp://localhost//"}, Observer: ctl, Logger: zap.NewNop()})
	if err == nil || !strings.Contains(err.Error(), "NoControl") {
		t.Fatalf("a Controller as Observer with the worker's own control: %v", err)
	}
	if _, err := NewWorker(NewRegistry(), Config{Broker: amqp.Config{URL: "amqp://localhost//"}, Observer: ctl, NoControl: true, Logger: zap.NewNop()}); err != nil {
		t.Fatalf("a Controller as Observer with NoControl: %v", err)
	}
}

// TestObserverBesideControl: with remote control and an Observer of the
// user's, the Observer gets every task event (each its own value) whether
// or not the control's task events are on.
func TestObserverBesideControl(t *testing.T) {
	t.Parallel()
	w, err := NewWorker(NewRegistry(), Config{Broker: amqp.Config{URL: "amqp://localhost//"}, Logger: zap.NewNop(),
		Observer: &valueObserver{}})
	if err != nil {
		t.Fatal(err)
	}
	user := w.cfg.Observer.(*valueObserver)
	if !w.wantEvents() {
		t.Fatal("an Observer without a TaskEvents method wants every event, control's task events off or not")
	}
	e := &celeryproto.TaskEvent{Type: "task-started", UUID: "a"}
	w.taskObs.TaskEvent(context.Background(), e)
	w.ctl.SetTaskEvents(true)
	e2 := &celeryproto.TaskEvent{Type: "task-started", UUID: "b"}
	w.taskObs.TaskEvent(context.Background(), e2)
	if len(user.got) != 2 || user.got[0] != e || user.got[1] != e2 {
		t.Fatalf("user Observer got %v", user.got)
	}
}

type valueObserver struct{ got []*celeryproto.TaskEvent }

func (o *valueObserver) Event(context.Context, string, map[string]any) {}
func (o *valueObserver) TaskEvent(_ context.Context, e *celeryproto.TaskEvent) {
	o.got = append(o.got, e)
}

// writeSelfSigned writes a self-signed certificate (its own CA) and its key.
func writeSelfSigned(t *testing.T) (certFile, keyFile string, cert *x509.Certificate) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "onceler test client"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true,
		KeyUsage:    x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	certFile, keyFile = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	if err := os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		t.Fatal(err)
	}
	cert, err = x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return certFile, keyFile, cert
}
