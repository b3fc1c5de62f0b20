package integration

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/internal/testenv"
)

// privatePostgres is a PostgreSQL server of the test's own (initdb in a
// temporary directory), so that the test may restart it without disturbing
// anyone else's tests.
type privatePostgres struct {
	bin, dir, data string
	port           int
	url            string
	opts           string // more server options (-c name=value ...)
}

// startPostgres initialises and starts a private PostgreSQL server, stopped
// and removed when the test ends.
func startPostgres(t *testing.T) *privatePostgres {
	t.Helper()
	return startPostgresWith(t, nil)
}

// startPostgresWith is startPostgres with setup run after initdb, before
// the server starts: it may write files in p.dir and returns more server
// options.
func startPostgresWith(t *testing.T, setup func(p *privatePostgres) string) *privatePostgres {
	t.Helper()
	bins, _ := filepath.Glob("/usr/lib/postgresql/*/bin/initdb")
	if len(bins) == 0 {
		if testenv.Required() {
			t.Fatal("initdb not found: a private PostgreSQL server is needed")
		}
		t.Skip("initdb not found")
	}
	dir, err := os.MkdirTemp("", "onceler-pg")
	if err != nil {
		t.Fatal(err)
	}
	p := &privatePostgres{bin: filepath.Dir(bins[len(bins)-1]), dir: dir, data: filepath.Join(dir, "data"), port: freePort(t)}
	p.url = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", p.port)
	if os.Geteuid() == 0 {
		if err := exec.Command("chown", "postgres", dir).Run(); err != nil {
			t.Fatalf("chown: %v", err)
		}
	}
	t.Cleanup(func() {
		_ = p.pgctl("stop", "-m", "immediate").Run()
		_ = os.RemoveAll(dir)
	})
	if out, err := p.command(filepath.Join(p.bin, "initdb"), "-D", p.data, "-A", "trust", "-U", "postgres", "--no-sync").CombinedOutput(); err != nil {
		t.Fatalf("initdb: %v\n%s", err, out)
	}
	if setup != nil {
		p.opts = setup(p)
	}
	if out, err := p.pgctl("start").CombinedOutput(); err != nil {
		t.Fatalf("pg_ctl start: %v\n%s", err, out)
	}
	p.waitReady(t)
	return p
}

func (p *privatePostgres) command(name string, args ...string) *exec.Cmd {
	if os.Geteuid() == 0 {
		return exec.Command("runuser", append([]string{"-u", "postgres", "--", name}, args...)...)
	}
	return exec.Command(name, args...)
}

func (p *privatePostgres) pgctl(args ...string) *exec.Cmd {
	opts := fmt.Sprintf("-p %d -k %s -c listen_addresses=127.0.0.1 -c max_connections=200 %s", p.port, p.dir, p.opts)
	args = append(args, "-D", p.data, "-w", "-t", "120", "-l", filepath.Join(p.dir, "log"), "-o", opts)
	return p.command(filepath.Join(p.bin, "pg_ctl"), args...)
}

// restart restarts the server with a shutdown mode: fast (clients
// disconnected, clean shutdown) or immediate (no shutdown: crash recovery).
func (p *privatePostgres) restart(t *testing.T, mode string) time.Duration {
	t.Helper()
	start := time.Now()
	if out, err := p.pgctl("restart", "-m", mode).CombinedOutput(); err != nil {
		t.Fatalf("pg_ctl restart -m %s: %v\n%s", mode, err, out)
	}
	p.waitReady(t)
	return time.Since(start)
}

func (p *privatePostgres) waitReady(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		c, err := pgx.Connect(ctx, p.url)
		if err == nil {
			_ = c.Close(ctx)
			cancel()
			return
		}
		cancel()
		if time.Now().After(deadline) {
			t.Fatalf("private PostgreSQL not ready: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	n, _ := strconv.Atoi(port)
	return n
}
