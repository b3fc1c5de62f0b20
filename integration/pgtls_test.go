package integration

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/internal/testkit"
)

// testCA is a certificate authority a test makes for itself.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

func newTestCA(t *testing.T, name string) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return &testCA{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// serverCert issues a server certificate for the DNS names only (no IP
// address), as PEM certificate and key.
func (ca *testCA) serverCert(t *testing.T, names ...string) (certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: names[0]}, DNSNames: names,
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb})
}

// startTLSPostgres starts a private PostgreSQL server with TLS on, its
// certificate issued by a CA of the test's own for "localhost" only, and
// returns it with the path of the CA's certificate.
func startTLSPostgres(t *testing.T) (*privatePostgres, string) {
	t.Helper()
	ca := newTestCA(t, "onceler test CA")
	caPath := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(caPath, ca.pem, 0o644); err != nil {
		t.Fatal(err)
	}
	certPEM, keyPEM := ca.serverCert(t, "localhost")
	pg := startPostgresWith(t, func(p *privatePostgres) string {
		crt, key := filepath.Join(p.dir, "server.crt"), filepath.Join(p.dir, "server.key")
		for path, b := range map[string][]byte{crt: certPEM, key: keyPEM} {
			if err := os.WriteFile(path, b, 0o600); err != nil {
				t.Fatal(err)
			}
			if os.Geteuid() == 0 {
				if err := exec.Command("chown", "postgres", path).Run(); err != nil {
					t.Fatalf("chown: %v", err)
				}
			}
		}
		return "-c ssl=on -c ssl_cert_file=" + crt + " -c ssl_key_file=" + key
	})
	return pg, caPath
}

// oncelerRun runs the onceler binary with env as its whole ONCELER_*
// environment and returns its exit code and stderr.
func oncelerRun(t *testing.T, env []string, args ...string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, oncelerBin, args...)
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME")}, env...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	err := cmd.Run()
	if cmd.ProcessState == nil {
		t.Fatalf("onceler %v: %v", args, err)
	}
	return cmd.ProcessState.ExitCode(), stderr.String()
}

// TestPostgresTLSVerifyFull: the worker reaches a PostgreSQL server over
// TLS with sslmode=verify-full and the test's CA (sslrootcert), runs a
// same-database task end to end with its result in a django-db backend on
// the same server over TLS, and every connection it holds there is
// encrypted. With a CA that did not sign the server's certificate, or a
// host name the certificate does not name (127.0.0.1 for a certificate of
// localhost), the worker exits at start with status 1 and one line that
// says why, without the URL's password.
func TestPostgresTLSVerifyFull(t *testing.T) {
	t.Parallel()
	pg, caPath := startTLSPostgres(t)
	tlsURL := fmt.Sprintf("postgres://postgres@localhost:%d/postgres?sslmode=verify-full&sslrootcert=%s", pg.port, caPath)

	e := replay.NewEnv(t, replay.Config{Binary: oncelerBin, Command: []string{"worker", "--migrate"}, DatabaseURL: tlsURL,
		Env: []string{"ONCELER_RESULT_BACKEND=django-db+" + tlsURL}})
	ctx := context.Background()
	// The table django-celery-results' migrations make, as the backend
	// writes it.
	if _, err := e.Pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS django_celery_results_taskresult (
    id serial PRIMARY KEY, task_id varchar(255) UNIQUE NOT NULL, status varchar(50) NOT NULL,
    content_type varchar(128) NOT NULL, content_encoding varchar(64) NOT NULL, result text,
    date_done timestamptz NOT NULL, traceback text, meta text, task_args text, task_kwargs text,
    task_name varchar(255), worker varchar(100), date_created timestamptz NOT NULL,
    periodic_task_name varchar(255))`); err != nil {
		t.Fatal(err)
	}
	w := e.StartWorker(replay.WorkerOptions{})
	op := testkit.Name("tls")
	id := e.Send(demo.TaskCredit, []any{"acct-" + op, op, 125}, nil)
	var status string
	testkit.WaitFor(t, "the task's result in the django-db backend", 60*time.Second, func() bool {
		err := e.Pool.QueryRow(ctx, `SELECT status FROM django_celery_results_taskresult WHERE task_id = $1`, id).Scan(&status)
		return err == nil && status == "SUCCESS"
	})
	if n, err := demo.CountLedger(ctx, e.Pool, op); err != nil || n != 1 {
		t.Fatalf("ledger rows of %s: %d, %v", op, n, err)
	}
	var tlsConns, plain int
	if err := e.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE s.ssl), count(*) FILTER (WHERE NOT s.ssl)
FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) WHERE a.backend_type = 'client backend'`).Scan(&tlsConns, &plain); err != nil {
		t.Fatal(err)
	}
	// The suite's own pool, the worker's record pool and its backend's.
	if plain != 0 || tlsConns < 3 {
		t.Fatalf("client connections: %d over TLS, %d in plain text", tlsConns, plain)
	}
	w.Stop()

	const pw = "tls-Pw-93c1"
	for _, tc := range []struct{ name, url, want string }{
		{"wrong CA", fmt.Sprintf("postgres://postgres:%s@localhost:%d/postgres?sslmode=verify-full&sslrootcert=%s", pw, pg.port, otherCA(t)),
			"certificate signed by unknown authority"},
		{"host name", fmt.Sprintf("postgres://postgres:%s@127.0.0.1:%d/postgres?sslmode=verify-full&sslrootcert=%s", pw, pg.port, caPath),
			"cannot validate certificate for 127.0.0.1 because it doesn't contain any IP SANs"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			start := time.Now()
			code, stderr := oncelerRun(t, []string{"ONCELER_DATABASE_URL=" + tc.url, "ONCELER_SCHEMA=" + e.Schema,
				"ONCELER_QUEUES=" + e.Queue, "ONCELER_BROKER_URL=" + e.AMQPURL}, "worker")
			lines := strings.Split(strings.TrimSpace(stderr), "\n")
			if code != 1 || len(lines) != 1 {
				t.Fatalf("exit %d, stderr:\n%s", code, stderr)
			}
			if !strings.Contains(lines[0], "onceler: PostgreSQL at postgres://postgres@") || !strings.Contains(lines[0], "its TLS certificate was refused") ||
				!strings.Contains(lines[0], tc.want) || strings.Contains(lines[0], pw) {
				t.Fatalf("stderr %q: want the redacted server and %q", lines[0], tc.want)
			}
			if took := time.Since(start); took > 15*time.Second {
				t.Errorf("took %v to refuse", took)
			}
			t.Log(lines[0])
		})
	}
}

// otherCA writes the certificate of a CA that signed nothing the server
// holds, and returns its path.
func otherCA(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "other-ca.pem")
	if err := os.WriteFile(path, newTestCA(t, "another CA").pem, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}
