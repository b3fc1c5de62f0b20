package tasks

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/onceler/onceler/internal/pause"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// redisProc is a private redis-server started by a test (the shared one on
// 6379 is left alone): append-only with an fsync per write, so that a
// kill -9 loses nothing it acknowledged.
type redisProc struct {
	t    *testing.T
	port int
	dir  string
	cmd  *exec.Cmd
}

func startRedisProc(t *testing.T) *redisProc {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		testenv.Unavailable(t, "redis-server not installed: %v", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	_ = ln.Close()
	p := &redisProc{t: t, port: port, dir: t.TempDir()}
	p.start(bin)
	t.Cleanup(p.kill)
	return p
}

func (p *redisProc) addr() string { return "127.0.0.1:" + strconv.Itoa(p.port) }

func (p *redisProc) start(bin string) {
	p.t.Helper()
	p.cmd = exec.Command(bin, "--port", strconv.Itoa(p.port), "--bind", "127.0.0.1", "--save", "",
		"--appendonly", "yes", "--appendfsync", "always", "--dir", p.dir, "--logfile", filepath.Join(p.dir, "redis.log"))
	if err := p.cmd.Start(); err != nil {
		p.t.Fatal(err)
	}
	testkit.WaitFor(p.t, "redis-server to listen", 10*time.Second, func() bool {
		c, err := net.DialTimeout("tcp", p.addr(), 200*time.Millisecond)
		if err != nil {
			return false
		}
		_ = c.Close()
		return true
	})
}

// kill ends the server with SIGKILL.
func (p *redisProc) kill() {
	if p.cmd == nil || p.cmd.Process == nil {
		return
	}
	_ = p.cmd.Process.Kill()
	_ = p.cmd.Wait()
	p.cmd = nil
}

// TestRedisRestartWhileDraining: Redis is killed (SIGKILL) and restarted
// while 1,000 tasks with results drain to real Celery callers: the worker
// holds each delivery unacknowledged and retries the result write until
// Redis is back, so no result is lost and every get() is answered (a
// get() that meets Redis down raises ConnectionError in Celery 5.2: the
// caller asks again, as an application would).
func TestRedisRestartWhileDraining(t *testing.T) {
	e := newEnv(t)
	rp := startRedisProc(t)
	bin, _ := exec.LookPath("redis-server")
	url := "redis://" + rp.addr() + "/0"
	reg := NewRegistry()
	if err := Register(reg, Task[addArgs]{Name: "t.slowadd", Run: func(ctx context.Context, _ *Call, a addArgs) (any, error) {
		pause.For(ctx, 20*time.Millisecond)
		return a.X + a.Y, nil
	}}); err != nil {
		t.Fatal(err)
	}
	cfg := e.config()
	cfg.ResultBackend = url
	cfg.Concurrency = 4
	e.start(reg, cfg)

	const n = 1000
	calls := make([]pyCall, n)
	for i := range calls {
		calls[i] = pyCall{Task: "t.slowadd", Args: []any{i, 1}}
	}
	spec, _ := json.Marshal(map[string]any{"protocol": 2, "serializer": "json", "backend": url, "broker": e.url,
		"queue": e.queue, "timeout": 120, "calls": calls, "announce_sent": true,
		"retry_connection_errors": true})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, testenv.Python(t), filepath.Join("testdata", "client.py"), string(spec))
	var stdout bytes.Buffer
	cmd.Stdout = &stdout
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	sent := make(chan struct{})
	var errLines []string
	scanDone := make(chan struct{})
	go func() {
		defer close(scanDone)
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			if sc.Text() == "SENT" {
				close(sent)
				continue
			}
			errLines = append(errLines, sc.Text())
		}
	}()
	select {
	case <-sent:
	case <-scanDone:
		t.Fatal("client.py ended before sending")
	case <-time.After(2 * time.Minute):
		t.Fatal("client.py did not send its calls within 2 minutes")
	}
	c := redisClient(t, rp.addr(), 0)
	testkit.WaitFor(t, "200 results in Redis", time.Minute, func() bool {
		k, err := c.DBSize(context.Background()).Result()
		return err == nil && k >= 200
	})
	before, _ := c.DBSize(context.Background()).Result()
	rp.kill()
	time.Sleep(2 * time.Second)
	rp.start(bin)
	if before >= n {
		t.Fatalf("all %d results were stored before Redis went down: the restart tested nothing", before)
	}
	t.Logf("Redis killed with %d of %d results stored, restarted 2 s later", before, n)

	<-scanDone
	if err := cmd.Wait(); err != nil {
		t.Fatalf("client.py: %v\n%s", err, strings.Join(errLines, "\n"))
	}
	var res struct{ Results []pyResult }
	if err := json.Unmarshal(stdout.Bytes(), &res); err != nil || len(res.Results) != n {
		t.Fatalf("client.py output (%v): %d results\n%s", err, len(res.Results), strings.Join(errLines, "\n"))
	}
	bad := 0
	for i, r := range res.Results {
		if string(r.OK) != fmt.Sprint(i+1) {
			if bad++; bad <= 5 {
				t.Errorf("call %d: %+v", i, r)
			}
		}
	}
	if bad > 0 {
		t.Fatalf("%d of %d calls not answered right", bad, n)
	}
	keys, err := c.Keys(context.Background(), TaskKeyPrefix+"*").Result()
	if err != nil || len(keys) != n {
		t.Errorf("%d result keys in Redis (%v), want %d", len(keys), err, n)
	}
	if d := e.queueDepth(e.queue); d != 0 {
		t.Errorf("%d messages left in the queue", d)
	}
}
