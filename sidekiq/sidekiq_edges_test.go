package sidekiq

import (
	"context"
	"errors"
	"io"
	"net"
	"net/url"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap/zaptest"
)

// stall makes c look like a process that stopped beating (a long GC
// pause, a slow Redis): it waits until c's heartbeat key has expired.
// c must have been made with a short HeartbeatTTL and have no Run.
func stall(t *testing.T, e *env, c *Client) {
	t.Helper()
	eventually(t, 5*time.Second, "the heartbeat of "+c.Identity()+" expires", func() bool {
		return e.rdb.Exists(context.Background(), c.Identity()).Val() == 0
	})
}

// A process whose heartbeat expired while it was merely slow is forgotten
// by the recovery of another process (its registration is deleted). If it
// fetches a job before its next heartbeat and then dies, nobody ever
// recovers that job: it stays in a working list no registry names.
func TestEdgeJobFetchedAfterRecoveryIsRecoveredAfterDeath(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	jids := pushMany(e, "orphan", 1, "W")
	slow := e.client(Config{Queues: []string{"orphan"}, Heartbeat: 200 * time.Millisecond, HeartbeatTTL: time.Second})
	other := e.client(Config{Queues: []string{"orphan"}})
	stall(t, e, slow)
	if _, err := other.RecoverDead(ctx); err != nil { // takes slow for dead
		t.Fatal(err)
	}
	// slow resumes: one of its workers fetches before its heartbeat
	// goroutine beats again, and then the process dies.
	j := fetch(t, slow, 5*time.Second)
	if j.JID != jids[0] {
		t.Fatalf("fetched %s, want %s", j.JID, jids[0])
	}
	_ = slow.Close()
	stall(t, e, slow)
	if _, err := other.RecoverDead(ctx); err != nil {
		t.Fatal(err)
	}
	if n := e.llen("queue:orphan"); n != 1 {
		t.Fatalf("the dead process's job is not back in its queue (queue holds %d, %s holds %d, registered: %v): lost",
			n, WorkingKey(slow.Identity(), "orphan"), e.llen(WorkingKey(slow.Identity(), "orphan")),
			e.rdb.HExists(ctx, keyWorkingReg, slow.Identity()).Val())
	}
}

// A process restarted with the same Config.Identity (a fixed name, such as
// a StatefulSet pod's host name) never gets back the jobs its previous
// run held when it crashed: RecoverDead skips its own identity and its
// new heartbeat makes the lists look alive to every other process.
func TestEdgeRestartWithSameIdentityRecoversLeftovers(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	jids := pushMany(e, "sts", 1, "W")
	cfg := Config{Identity: "worker-0", Queues: []string{"sts"}, Heartbeat: 200 * time.Millisecond,
		HeartbeatTTL: time.Second, RecoverInterval: 200 * time.Millisecond}
	first := e.client(cfg)
	if j := fetch(t, first, 5*time.Second); j.JID != jids[0] {
		t.Fatalf("fetched %s", j.JID)
	}
	_ = first.Close() // crashed: no Done, no RequeueAll
	stall(t, e, first)

	second := e.client(cfg)
	e.run(second, nil)
	deadline := time.Now().Add(5 * time.Second)
	for e.llen("queue:sts") == 0 && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	if n := e.llen("queue:sts"); n != 1 {
		t.Fatalf("after 5 s of the restarted process, the job of its crashed run is not back in its queue (%s holds %d)",
			WorkingKey("worker-0", "sts"), e.llen(WorkingKey("worker-0", "sts")))
	}
}

// A process taken for dead gets its job recovered, and one of its own
// workers fetches the same job (the same string) again. The stale run's
// settlement must fail with ErrNotHeld; instead it removes the copy the
// new run holds and puts the job in the retry set while the new run is
// still running it.
func TestEdgeStaleSettleAfterRefetchIsNotHeld(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	pushMany(e, "stale", 1, "W")
	a := e.client(Config{Queues: []string{"stale"}, Heartbeat: 200 * time.Millisecond, HeartbeatTTL: time.Second})
	b := e.client(Config{Queues: []string{"stale"}})
	old := fetch(t, a, 5*time.Second)
	stall(t, e, a)
	if n, err := b.RecoverDead(ctx); err != nil || n != 1 {
		t.Fatalf("RecoverDead: %d %v", n, err)
	}
	e.run(a, nil) // a beats again
	again := fetch(t, a, 5*time.Second)
	if again.Raw != old.Raw {
		t.Fatalf("fetched %s, want the recovered job %s", again.JID, old.JID)
	}
	_, err := a.Retry(ctx, old, "RuntimeError", "the stale run failed", nil)
	if !errors.Is(err, ErrNotHeld) {
		retries := e.rdb.ZCard(ctx, keyRetry).Val()
		errDone := a.Done(ctx, again)
		t.Fatalf("Retry of the recovered (stale) job: %v, want ErrNotHeld; the retry set now holds %d while the job runs again, whose Done then says: %v",
			err, retries, errDone)
	}
	if err := a.Done(ctx, again); err != nil {
		t.Fatalf("Done of the new run: %v", err)
	}
}

// Kill stores a job that is JSON but not an object (an array, a number)
// in the dead set as it is; Sidekiq's API (DeadSet#each, the Web UI's
// Dead page) then raises TypeError for the whole set.
func TestEdgeKilledNonObjectReadableBySidekiq(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	if err := e.rdb.LPush(ctx, "queue:odd", `[1,2]`).Err(); err != nil {
		t.Fatal(err)
	}
	c := e.client(Config{Queues: []string{"odd"}})
	j, err := c.Fetch(ctx)
	if !errors.Is(err, ErrBadJSON) {
		t.Fatalf("Fetch: %v", err)
	}
	if err := c.Kill(ctx, j, "DecodeError", err.Error()); err != nil {
		t.Fatal(err)
	}
	var dead []sortedEntry
	e.ruby("dead", nil, &dead) // fails: TypeError in Sidekiq::JobRecord
	if len(dead) != 1 {
		t.Fatalf("dead set %+v", dead)
	}
}

// The scheduler sends an entry of "schedule" that is not a JSON object to
// the dead set as it is: a number there breaks Sidekiq's DeadSet as above.
func TestEdgeScheduledNonObjectDeadReadableBySidekiq(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	if err := e.rdb.ZAdd(ctx, keySchedule, redis.Z{Score: 1, Member: `42`}).Err(); err != nil {
		t.Fatal(err)
	}
	c := e.client(Config{Queues: []string{"default"}})
	if _, err := c.EnqueueDue(ctx); err != nil {
		t.Fatal(err)
	}
	var dead []sortedEntry
	e.ruby("dead", nil, &dead) // fails: TypeError in Sidekiq::JobRecord
	if len(dead) != 1 {
		t.Fatalf("dead set %+v", dead)
	}
}

// retryOutcome is where a failed job went: "retry" or "dead", and its
// retry_count there.
func retryOutcome(t *testing.T, retry, dead []string) (string, any) {
	t.Helper()
	switch {
	case len(retry) == 1 && len(dead) == 0:
		m, err := decodeObject(retry[0])
		if err != nil {
			t.Fatal(err)
		}
		return "retry", m["retry_count"]
	case len(dead) == 1 && len(retry) == 0:
		m, err := decodeObject(dead[0])
		if err != nil {
			t.Fatal(err)
		}
		return "dead", m["retry_count"]
	}
	return "nowhere", nil
}

// A retry_count that is a JSON float (written by a producer that is not
// Ruby, or by a Ruby one that did arithmetic on it) counts in Sidekiq:
// 24.0 + 1 = 25.0 is not below 25, the job is dead. Retry reads it as 0
// and starts the count again at 1: the job gets 24 more retries.
func TestEdgeRetryCountFloatAsSidekiq(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	raw := `{"class":"HardWorker","args":[],"jid":"0123456789abcdef01234567","queue":"rc","retry":true,"retry_count":24.0}`
	var ruby struct {
		How   string   `json:"how"`
		Retry []string `json:"retry"`
		Dead  []string `json:"dead"`
	}
	e.ruby("job_retry", map[string]any{"job": raw, "queue": "rc"}, &ruby)
	wantWhere, wantCount := retryOutcome(t, ruby.Retry, ruby.Dead)
	if err := e.rdb.Del(ctx, keyRetry, keyDead).Err(); err != nil {
		t.Fatal(err)
	}
	if err := e.rdb.LPush(ctx, "queue:rc", raw).Err(); err != nil {
		t.Fatal(err)
	}
	c := e.client(Config{Queues: []string{"rc"}})
	j := fetch(t, c, 5*time.Second)
	if _, err := c.Retry(ctx, j, "RuntimeError", "boom", nil); err != nil {
		t.Fatal(err)
	}
	gotWhere, gotCount := retryOutcome(t, e.rdb.ZRange(ctx, keyRetry, 0, -1).Val(), e.rdb.ZRange(ctx, keyDead, 0, -1).Val())
	if gotWhere != wantWhere {
		t.Fatalf("job with retry_count 24.0 went to %s (retry_count %v); Sidekiq 6.4 puts it in %s (retry_count %v)",
			gotWhere, gotCount, wantWhere, wantCount)
	}
}

// An ActiveJob::Serializers::DurationSerializer value beyond time.Duration
// (about 292 years) wraps around to a negative duration instead of being
// refused.
func TestEdgeActiveJobDurationOverflow(t *testing.T) {
	t.Parallel()
	raw := `{"class":"` + JobWrapperClass + `","wrapped":"J","queue":"q","jid":"x","args":[{"job_class":"J","arguments":[` +
		`{"_aj_serialized":"ActiveJob::Serializers::DurationSerializer","value":10000000000,"parts":[["seconds",10000000000]]}]}]}`
	j, err := Decode(raw, "q")
	if err != nil {
		return // refused: fine
	}
	if d, ok := j.Args[0].(time.Duration); !ok || d <= 0 {
		t.Fatalf("a duration of 1e10 s decodes to %v (%T)", j.Args[0], j.Args[0])
	}
}

// Two jobs that are the same string (a producer that pushed one payload
// twice: Sidekiq's BasicFetch runs both) are two jobs in the working
// list, but Schedule stores each as it was fetched: the schedule set
// keeps one member, and both Schedule calls report success.
func TestEdgeScheduleTwoIdenticalJobsKeepsBoth(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	raw := `{"class":"W","args":[1],"jid":"0123456789abcdef01234567","queue":"dup","retry":true}`
	if err := e.rdb.LPush(ctx, "queue:dup", raw, raw).Err(); err != nil {
		t.Fatal(err)
	}
	c := e.client(Config{Queues: []string{"dup"}})
	j1 := fetch(t, c, 5*time.Second)
	j2 := fetch(t, c, 5*time.Second)
	at := time.Now().Add(time.Hour)
	err1 := c.Schedule(ctx, j1, at)
	err2 := c.Schedule(ctx, j2, at.Add(time.Minute))
	n := e.rdb.ZCard(ctx, keySchedule).Val()
	if err1 == nil && err2 == nil && n != 2 {
		t.Fatalf("two jobs scheduled without error, the schedule set holds %d; the working list %d", n, e.llen(WorkingKey(c.Identity(), "dup")))
	}
}

// dropProxy forwards TCP to Redis; when armed, it drops the next reply
// from Redis by closing that connection (a connection reset after Redis
// ran the command: a network blip, a proxy or load balancer restart).
type dropProxy struct {
	ln      net.Listener
	target  string
	armed   atomic.Bool
	dropped atomic.Int32
	again   atomic.Int32 // replies to drop after the armed one
}

// proxiedClient is a Client of e's database, consuming queue, whose
// connections go through a dropProxy.
func proxiedClient(t *testing.T, e *env, queue string) (*dropProxy, *Client) {
	t.Helper()
	u, err := url.Parse(e.url)
	if err != nil {
		t.Fatal(err)
	}
	proxy := newDropProxy(t, u.Host)
	u.Host = proxy.ln.Addr().String()
	c, err := New(Config{URL: u.String(), Queues: []string{queue}, Logger: zaptest.NewLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return proxy, c
}

func newDropProxy(t *testing.T, target string) *dropProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &dropProxy{ln: ln, target: target}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go p.handle(c)
		}
	}()
	return p
}

func (p *dropProxy) handle(client net.Conn) {
	server, err := net.Dial("tcp", p.target)
	if err != nil {
		_ = client.Close()
		return
	}
	go func() {
		_, _ = io.Copy(server, client)
		_ = server.Close()
	}()
	buf := make([]byte, 64<<10)
	for {
		n, err := server.Read(buf)
		if n > 0 {
			if p.armed.CompareAndSwap(true, false) {
				p.dropped.Add(1)
				if p.again.Add(-1) >= 0 {
					p.armed.Store(true)
				}
				_ = client.Close()
				_ = server.Close()
				return
			}
			if _, err := client.Write(buf[:n]); err != nil {
				_ = server.Close()
				return
			}
		}
		if err != nil {
			_ = client.Close()
			return
		}
	}
}

// When the reply to Fetch's move is lost (the connection drops after Redis
// ran it), the job moved is in this live process's working list but no
// caller has it: go-redis retries the script, which moves the next job,
// and the first one stays there, unsettled and unrecovered, for as long as
// the process lives.
func TestEdgeFetchReplyLostDoesNotStrandJob(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	jids := pushMany(e, "blip", 2, "W")
	proxy, c := proxiedClient(t, e, "blip")
	if err := fetchScript.Load(ctx, e.rdb).Err(); err != nil { // the reply dropped is the move's
		t.Fatal(err)
	}
	proxy.armed.Store(true)
	j, err := c.Fetch(ctx)
	if proxy.dropped.Load() != 1 {
		t.Fatalf("no reply dropped (Fetch: %v)", err)
	}
	held := 0
	if err == nil {
		held = 1
		if err := c.Done(ctx, j); err != nil {
			t.Fatal(err)
		}
	}
	stranded := e.lrange(WorkingKey(c.Identity(), "blip"))
	if len(stranded) != 0 {
		t.Fatalf("Fetch handed out %d job(s) (err %v), and %d job(s) stay in the working list of the live process with no holder (queue holds %d; pushed %v)",
			held, err, len(stranded), e.llen("queue:blip"), jids)
	}
}

// When the reply to Done is lost after Redis ran it, go-redis runs the
// script again, which finds nothing and reports ErrNotHeld: the caller is
// told that the job was recovered and will run again, and that nothing was
// written, while the job was in fact finished and is gone.
func TestEdgeDoneReplyLostIsNotErrNotHeld(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	pushMany(e, "blip2", 1, "W")
	proxy, c := proxiedClient(t, e, "blip2")
	j := fetch(t, c, 5*time.Second)
	if err := settleScript.Load(ctx, e.rdb).Err(); err != nil {
		t.Fatal(err)
	}
	proxy.armed.Store(true)
	err := c.Done(ctx, j)
	if proxy.dropped.Load() != 1 {
		t.Fatalf("no reply dropped (Done: %v)", err)
	}
	if errors.Is(err, ErrNotHeld) && e.llen("queue:blip2") == 0 && e.llen(WorkingKey(c.Identity(), "blip2")) == 0 {
		t.Fatalf("Done: %v, but the job was not recovered: it was finished and is nowhere, it will not run again", err)
	}
}
