package tasks

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// redisTestDB is the database of the shared Redis the tests write to; keys
// are unique per test (Celery's task ids).
const redisTestDB = 9

// redisClient opens a client of addr's database db for the test.
func redisClient(t *testing.T, addr string, db int) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: addr, DB: db, DisableIdentity: true})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// taskMeta reads and decodes celery-task-meta-<id>.
func taskMeta(t *testing.T, c *redis.Client, id string) map[string]any {
	t.Helper()
	b, err := c.Get(context.Background(), TaskKeyPrefix+id).Bytes()
	if err != nil {
		t.Fatalf("get meta of %s: %v", id, err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatalf("meta of %s: %v: %s", id, err, b)
	}
	return m
}

// pyRedis sends calls with real Celery using the Redis result backend url.
func (e *env) pyRedis(url string, calls ...pyCall) []pyResult {
	e.t.Helper()
	return e.pythonSpec(map[string]any{"protocol": 2, "serializer": "json", "backend": url}, calls...)
}

// redisRegistry: t.add, t.fail (KeyError), t.flaky (retries until its
// retries reach the argument) and t.once (outside mode, keyed by its
// argument, counting its runs).
func redisRegistry(t *testing.T, onceRuns *atomic.Int32) *Registry {
	t.Helper()
	reg := NewRegistry()
	for _, err := range []error{
		Register(reg, Task[addArgs]{Name: "t.add", Run: func(_ context.Context, _ *Call, a addArgs) (any, error) {
			return a.X + a.Y, nil
		}}),
		Register(reg, Task[flakyArgs]{Name: "t.fail", Run: func(_ context.Context, _ *Call, a flakyArgs) (any, error) {
			return nil, KeyError("no such account: " + a.Op)
		}}),
		Register(reg, Task[flakyArgs]{Name: "t.flaky", Retry: RetryPolicy{MaxRetries: 3},
			Run: func(_ context.Context, c *Call, a flakyArgs) (any, error) {
				if int64(c.Retries) < a.Failures {
					return nil, c.Retry(50*time.Millisecond, ValueError("not yet"))
				}
				return map[string]any{"retries": c.Retries}, nil
			}}),
		Register(reg, Task[flakyArgs]{Name: "t.once", Mode: ModeOutside,
			Key: func(a flakyArgs) (string, error) { return a.Op, nil },
			Run: func(_ context.Context, _ *Call, a flakyArgs) (any, error) {
				onceRuns.Add(1)
				return "done " + a.Op, nil
			}}),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	return reg
}

// TestRedisBackendCelery: with Celery's Redis result backend, real Celery
// callers get their results from a onceler worker: delay().get(), a failure
// raised as the task's exception type, a retry then success, an expired
// message REVOKED, a duplicate answered from the record, and a group of 50
// Go tasks; the stored meta is Celery's (task id, status, result,
// traceback, children, date_done, the request with result_extended) with
// the configured expiry.
func TestRedisBackendCelery(t *testing.T) {
	addr := testkit.RedisAddr(t)
	e := newEnv(t)
	var onceRuns atomic.Int32
	cfg := e.config()
	url := fmt.Sprintf("redis://%s/%d", addr, redisTestDB)
	cfg.ResultBackend = url
	cfg.ResultExpires = time.Hour
	cfg.ResultExtended = true
	e.start(redisRegistry(t, &onceRuns), cfg)

	op := testenv.Name("op")
	members := make([]pyCall, 50)
	want := make([]string, 50)
	for i := range members {
		members[i] = pyCall{Task: "t.add", Args: []any{i, 1000}}
		want[i] = fmt.Sprint(i + 1000)
	}
	res := e.pyRedis(url,
		pyCall{Task: "t.add", Args: []any{2, 3}},
		pyCall{Task: "t.fail", Args: []any{0, "acc-7"}},
		pyCall{Task: "t.flaky", Args: []any{2}},
		pyCall{Task: "t.add", Args: []any{1, 1}, Options: map[string]any{"countdown": 4, "expires": 1}},
		pyCall{Task: "t.once", Args: []any{0, op}},
		pyCall{Task: "t.once", Args: []any{0, op}, AfterPrevious: true},
		pyCall{Group: members},
	)
	if string(res[0].OK) != "5" {
		t.Errorf("delay().get(): %+v", res[0])
	}
	if r := res[1]; r.ExcType != "KeyError" || r.ExcModule != "builtins" || r.Message != "no such account: acc-7" {
		t.Errorf("failure: %+v, want KeyError", r)
	}
	if string(res[2].OK) != `{"retries": 2}` {
		t.Errorf("retry then success: %+v", res[2])
	}
	if r := res[3]; r.ExcType != "TaskRevokedError" || r.Message != "expired" {
		t.Errorf("expired: %+v, want TaskRevokedError expired", r)
	}
	if string(res[4].OK) != fmt.Sprintf("%q", "done "+op) || string(res[5].OK) != string(res[4].OK) {
		t.Errorf("duplicate: %s then %s", res[4].OK, res[5].OK)
	}
	if n := onceRuns.Load(); n != 1 {
		t.Errorf("t.once ran %d times, want once", n)
	}
	var got []json.Number
	if err := json.Unmarshal(res[6].OK, &got); err != nil || len(got) != 50 {
		t.Fatalf("group of 50: %s (%v)", res[6].OK, err)
	}
	for i := range got {
		if got[i].String() != want[i] {
			t.Errorf("group member %d: %s, want %s", i, got[i], want[i])
		}
	}

	c := redisClient(t, addr, redisTestDB)
	ctx := context.Background()
	m := taskMeta(t, c, res[0].ID)
	if m["status"] != "SUCCESS" || m["result"] != float64(5) || m["task_id"] != res[0].ID || m["traceback"] != nil {
		t.Errorf("SUCCESS meta: %v", m)
	}
	if ch, ok := m["children"].([]any); !ok || len(ch) != 0 {
		t.Errorf("children: %v", m["children"])
	}
	if d, _ := m["date_done"].(string); d == "" {
		t.Errorf("date_done missing: %v", m)
	} else if done, err := time.Parse("2006-01-02T15:04:05.999999", d); err != nil || time.Since(done) > time.Minute || time.Since(done) < 0 {
		t.Errorf("date_done %q is not a recent UTC isoformat: %v", d, err)
	}
	if m["name"] != "t.add" || fmt.Sprint(m["args"]) != "[2 3]" || fmt.Sprint(m["kwargs"]) != "map[]" ||
		m["worker"] != cfg.Hostname || m["retries"] != float64(0) || m["queue"] != e.queue {
		t.Errorf("extended meta: %v", m)
	}
	ttl, err := c.TTL(ctx, TaskKeyPrefix+res[0].ID).Result()
	if err != nil || ttl <= 59*time.Minute || ttl > time.Hour {
		t.Errorf("TTL %s (%v), want about 1h", ttl, err)
	}
	m = taskMeta(t, c, res[1].ID)
	exc, _ := m["result"].(map[string]any)
	if m["status"] != "FAILURE" || exc["exc_type"] != "KeyError" || exc["exc_module"] != "builtins" ||
		fmt.Sprint(exc["exc_message"]) != "[no such account: acc-7]" || m["traceback"] == nil {
		t.Errorf("FAILURE meta: %v", m)
	}
	if m = taskMeta(t, c, res[3].ID); m["status"] != "REVOKED" {
		t.Errorf("REVOKED meta: %v", m)
	}
	if m = taskMeta(t, c, res[2].ID); m["status"] != "SUCCESS" || m["retries"] != float64(2) {
		t.Errorf("meta after retries: %v", m)
	}
	// The duplicate's meta was written from the record.
	if m = taskMeta(t, c, res[5].ID); m["status"] != "SUCCESS" || m["result"] != "done "+op {
		t.Errorf("duplicate meta: %v", m)
	}
}

// TestResultBackendURL: the URLs Celery's Redis backend takes are read as
// Celery reads them; rpc:// and "" are the reply queues; other schemes and
// Celery's SQLAlchemy backend are refused in one line naming the schemes
// that work, without the password.
func TestResultBackendURL(t *testing.T) {
	for _, raw := range []string{"", "rpc://", "RPC://"} {
		b, err := newBackend(&Config{ResultBackend: raw})
		if err != nil || b != nil {
			t.Errorf("%q: %v, %v; want rpc (nil backend)", raw, b, err)
		}
	}
	for _, c := range []struct {
		raw                  string
		network, addr, user  string
		pass                 string
		db                   int
		tls, skipVerify      bool
		readTimeout, connect time.Duration
	}{
		{raw: "redis://", network: "", addr: "localhost:6379"},
		{raw: "redis://:s3cret@cache:6380/3", addr: "cache:6380", pass: "s3cret", db: 3},
		{raw: "redis://app:s3cret@cache/0", addr: "cache:6379", user: "app", pass: "s3cret"},
		{raw: "redis://[::1]:7000/15?socket_timeout=2.5&socket_connect_timeout=1", addr: "[::1]:7000", db: 15,
			readTimeout: 2500 * time.Millisecond, connect: time.Second},
		{raw: "rediss://:pw@secure:6390/1?ssl_cert_reqs=required", addr: "secure:6390", pass: "pw", db: 1, tls: true},
		{raw: "rediss://secure?ssl_cert_reqs=CERT_NONE", addr: "secure:6379", tls: true, skipVerify: true},
		{raw: "redis+socket:///var/run/redis/redis.sock?virtual_host=2", network: "unix", addr: "/var/run/redis/redis.sock", db: 2},
		{raw: "socket:///tmp/r.sock", network: "unix", addr: "/tmp/r.sock"},
	} {
		b, err := newBackend(&Config{ResultBackend: c.raw, ResultExpires: 90 * time.Second})
		if err != nil {
			t.Errorf("%q: %v", c.raw, err)
			continue
		}
		rb := b.(*redisBackend)
		o := rb.c.Options()
		if o.Addr != c.addr || o.Username != c.user || o.Password != c.pass || o.DB != c.db ||
			(o.TLSConfig != nil) != c.tls || (c.network == "unix") != (o.Network == "unix") {
			t.Errorf("%q: addr %q user %q pass %q db %d tls %v network %q", c.raw, o.Addr, o.Username, o.Password, o.DB,
				o.TLSConfig != nil, o.Network)
		}
		if c.skipVerify && !o.TLSConfig.InsecureSkipVerify {
			t.Errorf("%q: certificate still verified", c.raw)
		}
		if c.readTimeout != 0 && o.ReadTimeout != c.readTimeout || c.connect != 0 && o.DialTimeout != c.connect {
			t.Errorf("%q: timeouts %s, %s", c.raw, o.ReadTimeout, o.DialTimeout)
		}
		if rb.expires != 90 {
			t.Errorf("%q: expires %d s, want 90", c.raw, rb.expires)
		}
		if strings.Contains(rb.String(), "s3cret") || strings.Contains(rb.String(), ":pw@") {
			t.Errorf("%q: String %q shows the password", c.raw, rb.String())
		}
		_ = rb.close()
	}
	for _, raw := range []string{
		"db+postgresql://u:s3cret@db/app", "db+sqlite:///results.db", "amqp://guest:s3cret@localhost//",
		"django-db", "memcached://cache:11211", "redis://cache/notanumber", "redis://:s3cret@cache?ssl_cert_reqs=required",
		"rediss://cache?ssl_cert_reqs=maybe", "redis://cache?bogus=1", "redis+socket://",
	} {
		_, err := newBackend(&Config{ResultBackend: raw})
		if !errors.Is(err, ErrBackendURL) {
			t.Errorf("%q: %v, want ErrBackendURL", raw, err)
			continue
		}
		msg := err.Error()
		if strings.Contains(msg, "s3cret") || strings.Contains(msg, "\n") || !strings.Contains(msg, "rpc://, redis://, rediss://, redis+socket://") {
			t.Errorf("%q: refusal %q: want one line naming the schemes, no password", raw, msg)
		}
	}
	if got := redactURL("redis://:s3cret@cache:6379/0"); got != "redis://:****@cache:6379/0" {
		t.Errorf("redactURL: %q", got)
	}
}

// TestRedisStoreKeepsSuccess: a stored SUCCESS is never replaced (a late
// REVOKED or FAILURE of the same task id leaves it), in JSON and msgpack,
// as Celery's _store_result; every write that stores publishes the meta on
// the key's channel, with the expiry set.
func TestRedisStoreKeepsSuccess(t *testing.T) {
	addr := testkit.RedisAddr(t)
	ctx := context.Background()
	b, err := newBackend(&Config{ResultBackend: fmt.Sprintf("redis://%s/%d", addr, redisTestDB), ResultExpires: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = b.close() }()
	c := redisClient(t, addr, redisTestDB)
	for _, ser := range []string{"json", "msgpack", "yaml"} {
		id := testenv.Name("keep-" + ser)
		sub := c.Subscribe(ctx, TaskKeyPrefix+id)
		if _, err := sub.Receive(ctx); err != nil {
			t.Fatal(err)
		}
		meta := func(st celeryproto.State) []byte {
			r := &celeryproto.Result{TaskID: id, Status: st, Serializer: ser, Value: int64(7)}
			if st != celeryproto.StateSuccess {
				r.Value, r.Exception = nil, &celeryproto.Exception{Type: "TaskRevokedError", Module: "celery.exceptions"}
			}
			_, b, err := celeryproto.EncodeMeta(r, nil, time.Now())
			if err != nil {
				t.Fatal(err)
			}
			return b
		}
		for _, st := range []celeryproto.State{celeryproto.StateRetry, celeryproto.StateSuccess, celeryproto.StateRevoked, celeryproto.StateFailure} {
			if err := b.put(ctx, id, meta(st)); err != nil {
				t.Fatalf("%s %s: %v", ser, st, err)
			}
		}
		got, err := c.Get(ctx, TaskKeyPrefix+id).Bytes()
		if err != nil || !strings.Contains(string(got), "SUCCESS") {
			t.Errorf("%s: stored %q (%v), want the SUCCESS meta", ser, got, err)
		}
		var published []string
		for range 2 {
			mctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			msg, err := sub.ReceiveMessage(mctx)
			cancel()
			if err != nil {
				t.Fatalf("%s: published %d messages, then %v", ser, len(published), err)
			}
			published = append(published, msg.Payload)
		}
		if !strings.Contains(published[0], "RETRY") || !strings.Contains(published[1], "SUCCESS") {
			t.Errorf("%s: published %q, want RETRY then SUCCESS", ser, published)
		}
		mctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		if msg, err := sub.ReceiveMessage(mctx); err == nil {
			t.Errorf("%s: published after SUCCESS: %q", ser, msg.Payload)
		}
		cancel()
		_ = sub.Close()
		if ttl, err := c.TTL(ctx, TaskKeyPrefix+id).Result(); err != nil || ttl <= 50*time.Second || ttl > time.Minute {
			t.Errorf("%s: TTL %s (%v), want about 1m", ser, ttl, err)
		}
	}
}

// TestTrackStarted: with Config.TrackStarted the caller sees STARTED
// ({"pid", "hostname"}) while the task runs, then its outcome: in Redis
// (the meta, published) and on the reply queue (rpc://).
func TestTrackStarted(t *testing.T) {
	addr := testkit.RedisAddr(t)
	for _, backend := range []string{"redis", "rpc"} {
		t.Run(backend, func(t *testing.T) {
			e := newEnv(t)
			release := make(chan struct{})
			reg := NewRegistry()
			if err := Register(reg, Task[addArgs]{Name: "t.block", Run: func(ctx context.Context, _ *Call, a addArgs) (any, error) {
				select {
				case <-release:
				case <-ctx.Done():
				}
				return a.X + a.Y, nil
			}}); err != nil {
				t.Fatal(err)
			}
			cfg := e.config()
			cfg.TrackStarted = true
			if backend == "redis" {
				cfg.ResultBackend = fmt.Sprintf("redis://%s/%d", addr, redisTestDB)
			}
			e.start(reg, cfg)
			id := testenv.Name("started")
			c := redisClient(t, addr, redisTestDB)
			replyTo, replies := e.replyQueue()
			e.publish(&celeryproto.Message{Protocol: 2, Task: "t.block", ID: id, Args: []any{int64(2), int64(3)}, ReplyTo: replyTo})
			var states []string
			if backend == "redis" {
				testkit.WaitFor(t, "STARTED in Redis", 10*time.Second, func() bool {
					b, err := c.Get(context.Background(), TaskKeyPrefix+id).Bytes()
					return err == nil && strings.Contains(string(b), `"STARTED"`)
				})
				m := taskMeta(t, c, id)
				res, _ := m["result"].(map[string]any)
				if res["hostname"] != cfg.Hostname || res["pid"] != float64(os.Getpid()) || m["date_done"] != nil {
					t.Errorf("STARTED meta: %v", m)
				}
				close(release)
				testkit.WaitFor(t, "SUCCESS in Redis", 10*time.Second, func() bool { return taskMeta(t, c, id)["status"] == "SUCCESS" })
				return
			}
			for range 2 {
				select {
				case r := <-replies:
					states = append(states, fmt.Sprint(r["status"]))
					if r["status"] == "STARTED" {
						res, _ := r["result"].(map[string]any)
						if res["hostname"] != cfg.Hostname {
							t.Errorf("STARTED result: %v", r)
						}
						close(release)
					}
				case <-time.After(10 * time.Second):
					t.Fatalf("replies so far %v", states)
				}
			}
			if fmt.Sprint(states) != "[STARTED SUCCESS]" {
				t.Errorf("replies %v, want STARTED then SUCCESS", states)
			}
		})
	}
}

// TestWorkflowsWithRedis: chains, links, errbacks and groups sent by real
// Celery 5.2.6 with the Redis result backend over Go tasks, with a Python
// Celery worker (the same backend) serving a step of a mixed chain: every
// caller is answered from Redis; a failure carried along a chain reaches
// chain.get(). Chords: TestChordsWithRedis.
func TestWorkflowsWithRedis(t *testing.T) {
	addr := testkit.RedisAddr(t)
	e := newEnv(t)
	e.backend = fmt.Sprintf("redis://%s/%d", addr, redisTestDB)
	pyq := testenv.Name("pyq")
	rec := &callRecorder{}
	cfg := e.config()
	cfg.Routes = map[string]string{"py.mul": pyq, "py.kind": pyq}
	cfg.ResultBackend = e.backend
	e.start(workflowRegistry(t, rec), cfg)
	e.pythonWorker(pyq)
	res := e.workflows(pyq, "chain_go", "chain_mixed", "chain_py_first", "chain_group", "chain_group_fail", "chain_bad_args",
		"chain_fail", "link", "link_error", "group")
	for name, want := range map[string]string{
		"chain_go":       `113`,
		"chain_mixed":    `130`,
		"chain_py_first": `10`,
		"chain_group":    `[13, 23]`,
		"group":          `[2, 4, 9]`,
	} {
		if got := string(res[name].OK); got != want {
			t.Errorf("%s: got %s (%+v), want %s", name, got, res[name], want)
		}
	}
	for name, want := range map[string]string{"chain_group_fail": "ValueError", "chain_bad_args": "TypeError",
		"chain_fail": "ValueError"} {
		if r := res[name]; r.ExcType != want {
			t.Errorf("%s: %+v, want %s", name, r, want)
		}
	}
	var link struct{ Result int64 }
	if err := json.Unmarshal(res["link"].OK, &link); err != nil || link.Result != 3 {
		t.Errorf("link: %s %v", res["link"].OK, err)
	}
	var linkErr struct {
		ID      string
		ExcType string `json:"exc_type"`
	}
	if err := json.Unmarshal(res["link_error"].OK, &linkErr); err != nil || linkErr.ExcType != "ValueError" {
		t.Errorf("link_error: %s %v", res["link_error"].OK, err)
	}
	testkit.WaitFor(t, "callback and errback", 10*time.Second, func() bool {
		return len(rec.byTag("callback")) > 0 && len(rec.byTag("errback")) > 0
	})
}

// TestRedisResultOverBulkLimit: a result longer than the Redis server's
// proto-max-bulk-len (here 1 MB, a documented setting) is refused on every
// write: the backend calls the error permanent, so the worker stores a
// ResultNotStored failure instead of retrying for ever.
func TestRedisResultOverBulkLimit(t *testing.T) {
	p := startRedisProc(t)
	ctx := context.Background()
	c := redisClient(t, p.addr(), 0)
	if err := c.ConfigSet(ctx, "proto-max-bulk-len", "1mb").Err(); err != nil {
		t.Fatal(err)
	}
	b, err := newBackend(&Config{ResultBackend: "redis://" + p.addr() + "/0", ResultExpires: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = b.close() }()
	if err := b.ping(ctx); err != nil { // as the worker does at start
		t.Fatal(err)
	}
	id := testenv.Name("big")
	_, meta, err := celeryproto.EncodeMeta(&celeryproto.Result{TaskID: id, Status: celeryproto.StateSuccess,
		Serializer: "json", Value: strings.Repeat("x", 2<<20)}, nil, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	var errs []error
	for range 3 {
		pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		errs = append(errs, b.put(pctx, id, meta))
		cancel()
	}
	for i, err := range errs {
		if err == nil {
			t.Fatalf("write %d of a 2 MB result stored despite proto-max-bulk-len 1mb", i)
		}
		if !b.permanent(err) {
			t.Errorf("write %d: %v: permanent() = false; the same error comes on every retry, so storeResult retries for ever", i, err)
		}
	}
}
