package sidekiq

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// A retry_count that is not a number makes Sidekiq's own retry fail; the
// job goes to the dead set with an error_class that says why, readable by
// Sidekiq's API.
func TestRetryCountNotANumberGoesDead(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	raw := `{"class":"W","args":[],"jid":"0123456789abcdef01234567","queue":"rcs","retry":true,"retry_count":"3"}`
	if err := e.rdb.LPush(ctx, "queue:rcs", raw).Err(); err != nil {
		t.Fatal(err)
	}
	c := e.client(Config{Queues: []string{"rcs"}})
	j := fetch(t, c, 5*time.Second)
	out, err := c.Retry(ctx, j, "RuntimeError", "boom", nil)
	if err != nil || out != Dead {
		t.Fatalf("Retry: outcome %v, %v", out, err)
	}
	var entries []sortedEntry
	e.ruby("dead", nil, &entries)
	if len(entries) != 1 || entries[0].Item["error_class"] != invalidRetryCountClass || entries[0].JID != j.JID {
		t.Fatalf("dead set %+v", entries)
	}
	if n := e.llen(WorkingKey(c.Identity(), "rcs")); n != 0 {
		t.Fatalf("working list holds %d", n)
	}
}

// A job without "retry" is retried and stored with "retry" true, as a
// Ruby worker's default option makes it.
func TestRetryWritesRetryTrueWhenAbsent(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	raw := `{"class":"W","args":[],"jid":"0123456789abcdef01234567","queue":"rt"}`
	if err := e.rdb.LPush(ctx, "queue:rt", raw).Err(); err != nil {
		t.Fatal(err)
	}
	c := e.client(Config{Queues: []string{"rt"}})
	j := fetch(t, c, 5*time.Second)
	if out, err := c.Retry(ctx, j, "RuntimeError", "boom", nil); err != nil || out != Retried {
		t.Fatalf("Retry: outcome %v, %v", out, err)
	}
	var retries []sortedEntry
	e.ruby("retries", nil, &retries)
	if len(retries) != 1 || retries[0].Item["retry"] != true {
		t.Fatalf("retry set %+v", retries)
	}
}

// A settlement whose target key has the wrong type fails and writes
// nothing: the job stays in the working list, and settles once the key is
// right.
func TestSettleWrongTypeKeepsJob(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	pushMany(e, "wt", 1, "W")
	c := e.client(Config{Queues: []string{"wt"}})
	j := fetch(t, c, 5*time.Second)
	for _, k := range []string{keySchedule, keyQueues} {
		if err := e.rdb.Set(ctx, k, "not a set", 0).Err(); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Schedule(ctx, j, time.Now().Add(time.Hour)); err == nil || errors.Is(err, ErrNotHeld) {
		t.Fatalf("Schedule into a string key: %v", err)
	}
	if err := c.Requeue(ctx, j); err == nil || errors.Is(err, ErrNotHeld) {
		t.Fatalf("Requeue with a string %q: %v", keyQueues, err)
	}
	if got := e.lrange(WorkingKey(c.Identity(), "wt")); len(got) != 1 || got[0] != j.Raw {
		t.Fatalf("working list %q", got)
	}
	if err := e.rdb.Del(ctx, keySchedule, keyQueues).Err(); err != nil {
		t.Fatal(err)
	}
	if err := c.Requeue(ctx, j); err != nil {
		t.Fatal(err)
	}
	if got := e.rdb.SMembers(ctx, keyQueues).Val(); len(got) != 1 || got[0] != "wt" {
		t.Fatalf("queues %v after Requeue", got)
	}
	if n := e.llen("queue:wt"); n != 1 {
		t.Fatalf("queue holds %d", n)
	}
}

// The scheduler leaves a due job in its set when its queue key has the
// wrong type, instead of removing it and failing to push it.
func TestEnqueueDueWrongTypeKeepsJob(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	member := `{"class":"W","args":[],"jid":"0123456789abcdef01234567","queue":"wtq"}`
	if err := e.rdb.ZAdd(ctx, keySchedule, redis.Z{Score: 1, Member: member}).Err(); err != nil {
		t.Fatal(err)
	}
	if err := e.rdb.Set(ctx, "queue:wtq", "x", 0).Err(); err != nil {
		t.Fatal(err)
	}
	c := e.client(Config{Queues: []string{"wtq"}})
	if _, err := c.EnqueueDue(ctx); err == nil {
		t.Fatal("EnqueueDue into a string key: no error")
	}
	if got := e.rdb.ZRange(ctx, keySchedule, 0, -1).Val(); len(got) != 1 || got[0] != member {
		t.Fatalf("schedule %q", got)
	}
	if err := e.rdb.Del(ctx, "queue:wtq").Err(); err != nil {
		t.Fatal(err)
	}
	if n, err := c.EnqueueDue(ctx); err != nil || n != 1 {
		t.Fatalf("EnqueueDue: %d %v", n, err)
	}
}

// Recovery puts the queues it refills back into "queues", where Sidekiq's
// API looks for them.
func TestRequeueAllAddsQueue(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	pushMany(e, "rq", 2, "W")
	c := e.client(Config{Queues: []string{"rq"}})
	fetch(t, c, 5*time.Second)
	fetch(t, c, 5*time.Second)
	if err := e.rdb.Del(ctx, keyQueues).Err(); err != nil {
		t.Fatal(err)
	}
	if n, err := c.RequeueAll(ctx); err != nil || n != 2 {
		t.Fatalf("RequeueAll: %d %v", n, err)
	}
	if got := e.rdb.SMembers(ctx, keyQueues).Val(); len(got) != 1 || got[0] != "rq" {
		t.Fatalf("queues %v", got)
	}
}

// Run's callback may stop Run and wait for it to return: it runs on a
// goroutine of its own.
func TestSignalCallbackMayWaitForRun(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	c := e.client(Config{Queues: []string{"sigw"}, Heartbeat: 100 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	returned := make(chan struct{})
	waited := make(chan struct{})
	go func() {
		defer close(returned)
		_ = c.Run(ctx, func(sig string) {
			if sig != "TERM" {
				return
			}
			cancel()
			<-returned
			close(waited)
		})
	}()
	e.ruby("signal", map[string]any{"identity": c.Identity(), "signal": "TERM"}, nil)
	select {
	case <-waited:
	case <-time.After(10 * time.Second):
		t.Fatal("the callback that waits for Run to return is still waiting after 10 s")
	}
}

// When every attempt of a Fetch loses its reply (go-redis gives up), the
// job the first attempt moved is handed out by the next Fetch instead of
// staying in the working list with no holder.
func TestFetchWhoseRepliesAreAllLostHandsOutItsJobNext(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	jids := pushMany(e, "blip3", 2, "W")
	proxy, c := proxiedClient(t, e, "blip3")
	if err := fetchScript.Load(ctx, e.rdb).Err(); err != nil {
		t.Fatal(err)
	}
	proxy.again.Store(1000)
	proxy.armed.Store(true)
	fctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	j, err := c.Fetch(fctx)
	proxy.again.Store(0)
	proxy.armed.Store(false)
	if err == nil {
		t.Fatalf("Fetch through a connection that loses every reply: %+v", j)
	}
	if n := e.llen(WorkingKey(c.Identity(), "blip3")); n != 1 {
		t.Fatalf("working list holds %d after the failed Fetch, want the job its first attempt moved", n)
	}
	j = fetch(t, c, 5*time.Second)
	if j.JID != jids[0] {
		t.Fatalf("next Fetch: %s, want %s, the job moved by the failed one", j.JID, jids[0])
	}
	if err := c.Done(ctx, j); err != nil {
		t.Fatal(err)
	}
	if n := e.llen(WorkingKey(c.Identity(), "blip3")); n != 0 {
		t.Fatalf("working list holds %d", n)
	}
	if n := e.llen("queue:blip3"); n != 1 {
		t.Fatalf("queue holds %d", n)
	}
}
