package cmd

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/onceler/onceler/control"
	"github.com/onceler/onceler/internal/testenv"
)

// TestWorkerDefaultNodeNameIsUniquePerProcess starts two workers on one host
// without --hostname: each takes the name onceler-<pid>@<host>, and Celery's
// remote control reaches each under its own name.
func TestWorkerDefaultNodeNameIsUniquePerProcess(t *testing.T) {
	s := newStack(t)
	host, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	workers := []*proc{startWorker(t, s.env), startWorker(t, s.env)}
	var nodes []string
	for _, w := range workers {
		node := fmt.Sprintf("onceler-%d@%s", w.cmd.Process.Pid, host)
		w.waitLog(`"node":"`+node+`"`, 10*time.Second)
		nodes = append(nodes, node)
	}
	if nodes[0] == nodes[1] {
		t.Fatalf("two workers share the node name %s", nodes[0])
	}
	for _, node := range nodes {
		got := celeryInspect(t, s.env, node)
		if len(got["ping"]) != 1 || fmt.Sprint(got["ping"][node]) != "map[ok:pong]" {
			t.Fatalf("celery inspect ping of %s: %v", node, got["ping"])
		}
	}
	for _, w := range workers {
		w.stop()
	}
}

// celeryInspect asks node, as "celery inspect" does, for ping and
// registered, and returns the replies by command and node.
func celeryInspect(t *testing.T, env map[string]string, node string) map[string]map[string]any {
	t.Helper()
	ping := start(t, "celery inspect", env, testenv.Python(t), "-c", inspectPy, node)
	if err := ping.wait(60 * time.Second); err != nil {
		t.Fatalf("inspect: %v\n%s", err, ping.stderr.String())
	}
	var got map[string]map[string]any
	if err := json.Unmarshal([]byte(ping.stdout.String()), &got); err != nil {
		t.Fatalf("inspect output %q: %v", ping.stdout.String(), err)
	}
	return got
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

// TestControlConfigUsesBrokerTLS: the remote control connection gets the
// worker's broker URL, CA and client certificate.
func TestControlConfigUsesBrokerTLS(t *testing.T) {
	certFile, keyFile, cert := writeSelfSigned(t)
	f := &workerFlags{concurrency: 3, prefetch: 7, events: true}
	f.broker = brokerFlags{url: "amqps://u:p@rabbit.example:5671//", caFile: certFile, certFile: certFile, keyFile: keyFile}
	cc, err := f.controlConfig(f.broker.config("n@h"), "n@h", 3, 7)
	if err != nil {
		t.Fatal(err)
	}
	if cc.URL != f.broker.url || cc.NodeName != "n@h" || !cc.TaskEvents || cc.Concurrency != 3 || cc.Prefetch != 7 {
		t.Fatalf("control config %+v", cc)
	}
	if cc.TLS == nil || len(cc.TLS.Certificates) != 1 {
		t.Fatalf("control TLS %+v: want the client certificate", cc.TLS)
	}
	leaf, err := x509.ParseCertificate(cc.TLS.Certificates[0].Certificate[0])
	if err != nil || !leaf.Equal(cert) {
		t.Fatalf("control client certificate is not --broker-cert-file (%v)", err)
	}
	if _, err := cert.Verify(x509.VerifyOptions{Roots: cc.TLS.RootCAs, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		t.Fatalf("control RootCAs do not hold --broker-ca-file: %v", err)
	}
	if cc.TLS.ServerName != "rabbit.example" {
		t.Fatalf("control TLS ServerName %q", cc.TLS.ServerName)
	}

	// Plain amqp://: no TLS; TLS files on it: a usage error, as for the worker.
	f.broker = brokerFlags{url: "amqp://localhost//"}
	if cc, err := f.controlConfig(f.broker.config("n@h"), "n@h", 3, 7); err != nil || cc.TLS != nil {
		t.Fatalf("amqp:// control config TLS %v, %v", cc.TLS, err)
	}
	f.broker.certFile, f.broker.keyFile = certFile, keyFile
	var u *usageError
	if _, err := f.controlConfig(f.broker.config("n@h"), "n@h", 3, 7); !errors.As(err, &u) {
		t.Fatalf("TLS files on amqp:// = %v, want a usage error", err)
	}
}

// TestWorkerHostnameDefault: --hostname defaults to control's per-process
// pattern, which expands to a name holding this process's id.
func TestWorkerHostnameDefault(t *testing.T) {
	c := workerCommand()
	fs := newFlagSet(c)
	c.setup(&app{getenv: func(string) string { return "" }}, fs)
	def := fs.fs.Lookup("hostname").DefValue
	if def != control.DefaultNodeName {
		t.Fatalf("--hostname default %q, want %q", def, control.DefaultNodeName)
	}
	node, err := control.NodeName(def)
	if err != nil {
		t.Fatal(err)
	}
	if want := fmt.Sprintf("onceler-%d@", os.Getpid()); len(node) <= len(want) || node[:len(want)] != want {
		t.Fatalf("default node name %q, want %s<host>", node, want)
	}
}
