package sidekiq

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap/zaptest"
)

func TestMain(m *testing.M) { os.Exit(testenv.Main(m, nil)) }

// env is one test's Redis database, empty when the test starts and
// flushed when it ends.
type env struct {
	t   *testing.T
	url string
	rdb *redis.Client
}

// newEnv takes a free Redis database for the test (testkit.RedisDB).
func newEnv(t *testing.T) *env {
	t.Helper()
	addr := testkit.RedisAddr(t)
	testkit.RequireRubySidekiq(t)
	url, rdb := testkit.RedisDB(t, addr)
	return &env{t: t, url: url, rdb: rdb}
}

// ruby runs the Sidekiq helper script and decodes its JSON output into out
// (nil: ignored).
func (e *env) ruby(cmd string, arg any, out any) {
	e.t.Helper()
	args := []string{"testdata/sidekiq_helper.rb", cmd}
	if arg != nil {
		b, err := json.Marshal(arg)
		if err != nil {
			e.t.Fatal(err)
		}
		args = append(args, string(b))
	}
	c := exec.Command(testkit.RubySidekiq, args...)
	c.Env = append(os.Environ(), "REDIS_URL="+e.url)
	var stderr strings.Builder
	c.Stderr = &stderr
	b, err := c.Output()
	if err != nil {
		e.t.Fatalf("ruby %s: %v\n%s", cmd, err, stderr.String())
	}
	if out == nil {
		return
	}
	dec := json.NewDecoder(strings.NewReader(string(b)))
	dec.UseNumber()
	if err := dec.Decode(out); err != nil {
		e.t.Fatalf("ruby %s output %q: %v", cmd, b, err)
	}
}

// client returns a Client of the test's database, closed at the end.
func (e *env) client(cfg Config) *Client {
	e.t.Helper()
	cfg.URL = e.url
	if cfg.Logger == nil {
		cfg.Logger = zaptest.NewLogger(e.t)
	}
	c, err := New(cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { _ = c.Close() })
	return c
}

// run runs c.Run until the test ends (or stop is called).
func (e *env) run(c *Client, onSignal func(string)) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		if err := c.Run(ctx, onSignal); err != nil {
			e.t.Errorf("Run: %v", err)
		}
	}()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); wg.Wait() }) }
	e.t.Cleanup(stop)
	return stop
}

// fetch fetches one job, failing the test after d.
func fetch(t *testing.T, c *Client, d time.Duration) *Job {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	j, err := c.Fetch(ctx)
	if err != nil {
		t.Fatalf("Fetch: %v", err)
	}
	return j
}

// eventually polls cond until it holds, failing the test after d.
func eventually(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not within %v: %s", d, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (e *env) llen(key string) int64 {
	e.t.Helper()
	n, err := e.rdb.LLen(context.Background(), key).Result()
	if err != nil {
		e.t.Fatal(err)
	}
	return n
}

func (e *env) lrange(key string) []string {
	e.t.Helper()
	v, err := e.rdb.LRange(context.Background(), key, 0, -1).Result()
	if err != nil {
		e.t.Fatal(err)
	}
	return v
}

// sortedEntry is an entry of Sidekiq::RetrySet, DeadSet or ScheduledSet as
// the Ruby helper prints it.
type sortedEntry struct {
	Score          json.Number    `json:"score"`
	JID            string         `json:"jid"`
	Item           map[string]any `json:"item"`
	Value          string         `json:"value"`
	Klass          string         `json:"klass"`
	DisplayClass   string         `json:"display_class"`
	ErrorBacktrace []string       `json:"error_backtrace"`
}

func num(t *testing.T, v any) float64 {
	t.Helper()
	n, ok := v.(json.Number)
	if !ok {
		t.Fatalf("%v (%T) is not a number", v, v)
	}
	f, err := n.Float64()
	if err != nil {
		t.Fatal(err)
	}
	return f
}
