package integration

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
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
	p := newPrivatePostgres(t)
	p.initdb(t)
	if setup != nil {
		p.opts = setup(p)
	}
	p.start(t)
	return p
}

// newPrivatePostgres prepares the directory and port of a private server
// (neither initialised nor started), stopped and removed when the test ends.
func newPrivatePostgres(t *testing.T) *privatePostgres {
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
	return p
}

func (p *privatePostgres) initdb(t *testing.T) {
	t.Helper()
	if out, err := p.command(filepath.Join(p.bin, "initdb"), "-D", p.data, "-A", "trust", "-U", "postgres", "--no-sync").CombinedOutput(); err != nil {
		t.Fatalf("initdb: %v\n%s", err, out)
	}
}

func (p *privatePostgres) start(t *testing.T) {
	t.Helper()
	if out, err := p.pgctl("start").CombinedOutput(); err != nil {
		t.Fatalf("pg_ctl start: %v\n%s\n%s", err, out, p.logTail())
	}
	p.waitReady(t)
}

// stop stops the server: -m fast (clients disconnected, clean shutdown) or
// immediate (no shutdown: what a crash leaves).
func (p *privatePostgres) stop(t *testing.T, mode string) {
	t.Helper()
	if out, err := p.pgctl("stop", "-m", mode).CombinedOutput(); err != nil {
		t.Fatalf("pg_ctl stop -m %s: %v\n%s", mode, err, out)
	}
}

// appendConf appends lines to a configuration file of the data directory
// (postgresql.conf, postgresql.auto.conf, pg_hba.conf).
func (p *privatePostgres) appendConf(t *testing.T, file string, lines ...string) {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(p.data, file), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteString("\n" + strings.Join(lines, "\n") + "\n"); err != nil {
		t.Fatal(err)
	}
}

// logTail is the end of the server's log, for failure messages.
func (p *privatePostgres) logTail() string {
	b, _ := os.ReadFile(filepath.Join(p.dir, "log"))
	if len(b) > 3000 {
		b = b[len(b)-3000:]
	}
	return string(b)
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

// standbyName is the standby's application_name, the name the primary's
// synchronous_standby_names gives.
const standbyName = "standby1"

// replicatedPostgres is a private primary and a standby streaming from it,
// each on its own port: the standby is a pg_basebackup -R copy whose
// replication connection passes through link, a proxy the test can black-
// hole (a network partition between the two).
type replicatedPostgres struct {
	primary, standby *privatePostgres
	link             *blackhole
	// url lists both servers with target_session_attrs=read-write: the
	// database URL a worker follows a failover with.
	url string
}

// startReplicated starts a primary (wal_level replica, synchronous_commit
// on) and a standby: synchronous (synchronous_standby_names names it: a
// commit returns once the standby has flushed it) when sync, asynchronous
// otherwise. Both are stopped and removed when the test ends.
func startReplicated(t *testing.T, sync bool) *replicatedPostgres {
	t.Helper()
	names := ""
	if sync {
		names = standbyName
	}
	primary := newPrivatePostgres(t)
	primary.initdb(t)
	primary.appendConf(t, "postgresql.conf",
		"wal_level = replica", "max_wal_senders = 5", "wal_keep_size = '256MB'", "synchronous_commit = on",
		fmt.Sprintf("synchronous_standby_names = '%s'", names))
	primary.appendConf(t, "pg_hba.conf", "host replication postgres 127.0.0.1/32 trust")
	primary.start(t)
	link := newBlackhole(t, fmt.Sprintf("127.0.0.1:%d", primary.port))
	host, port, _ := net.SplitHostPort(link.addr())
	conninfo := fmt.Sprintf("host=%s port=%s user=postgres application_name=%s", host, port, standbyName)
	standby := newPrivatePostgres(t)
	if out, err := standby.command(filepath.Join(standby.bin, "pg_basebackup"), "-D", standby.data, "-R", "-X", "stream",
		"-c", "fast", "-d", conninfo).CombinedOutput(); err != nil {
		t.Fatalf("pg_basebackup: %v\n%s", err, out)
	}
	// The promoted standby has no standby of its own: naming one would make
	// its every commit wait.
	standby.appendConf(t, "postgresql.auto.conf", "primary_conninfo = '"+conninfo+"'", "synchronous_standby_names = ''")
	standby.start(t)
	r := &replicatedPostgres{primary: primary, standby: standby, link: link,
		url: fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/postgres?sslmode=disable&target_session_attrs=read-write",
			primary.port, standby.port)}
	want := "async"
	if sync {
		want = "sync"
	}
	var state string
	if !testkit.Eventually(time.Minute, func() bool {
		state = r.queryPrimary(t, `SELECT coalesce((SELECT state || ' ' || sync_state FROM pg_stat_replication WHERE application_name = $1), '')`, standbyName)
		return state == "streaming "+want
	}) {
		t.Fatalf("standby not streaming (%s), want streaming %s\n%s", state, want, standby.logTail())
	}
	return r
}

// queryPrimary runs a query on the primary and returns its one text value.
func (r *replicatedPostgres) queryPrimary(t *testing.T, sql string, args ...any) string {
	t.Helper()
	return queryOne(t, r.primary.url, sql, args...)
}

// queryOne runs a query on url and returns its one value as text.
func queryOne(t *testing.T, url, sql string, args ...any) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	defer c.Close(ctx)
	var v string
	if err := c.QueryRow(ctx, sql, args...).Scan(&v); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return v
}

// waitCaughtUp waits until the standby has received and flushed every WAL
// record the primary has written so far.
func (r *replicatedPostgres) waitCaughtUp(t *testing.T) {
	t.Helper()
	lsn := r.queryPrimary(t, `SELECT pg_current_wal_lsn()::text`)
	var got string
	if !testkit.Eventually(time.Minute, func() bool {
		got = queryOne(t, r.standby.url, `SELECT (pg_last_wal_receive_lsn() >= $1::pg_lsn)::text`, lsn)
		return got == "true"
	}) {
		t.Fatalf("standby did not receive the primary's WAL up to %s", lsn)
	}
}

// promote makes the standby a primary (pg_ctl promote) and waits until it
// accepts writes.
func (r *replicatedPostgres) promote(t *testing.T) {
	t.Helper()
	s := r.standby
	if out, err := s.command(filepath.Join(s.bin, "pg_ctl"), "promote", "-D", s.data, "-w", "-t", "60").CombinedOutput(); err != nil {
		t.Fatalf("pg_ctl promote: %v\n%s\n%s", err, out, s.logTail())
	}
	if v := queryOne(t, s.url, `SELECT pg_is_in_recovery()::text`); v != "false" {
		t.Fatalf("promoted standby still in recovery")
	}
}
