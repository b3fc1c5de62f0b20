package sidekiq

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"
)

func pushMany(e *env, queue string, n int, class string) []string {
	items := make([]map[string]any, n)
	for i := range items {
		items[i] = map[string]any{"class": class, "args": []any{i}, "queue": queue}
	}
	var jids []string
	e.ruby("push_many", items, &jids)
	return jids
}

func TestFetchStrictOrder(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	low := pushMany(e, "low", 3, "LowWorker")
	high := pushMany(e, "high", 3, "HighWorker")
	c := e.client(Config{Queues: []string{"high", "low"}})
	var got []string
	for range 6 {
		j := fetch(t, c, 5*time.Second)
		got = append(got, j.Queue+":"+j.JID)
		if err := c.Done(context.Background(), j); err != nil {
			t.Fatal(err)
		}
	}
	var want []string
	for _, jid := range high {
		want = append(want, "high:"+jid)
	}
	for _, jid := range low {
		want = append(want, "low:"+jid)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("fetched %v, want (strict order, oldest first) %v", got, want)
	}
}

func TestFetchWeightedOrder(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	pushMany(e, "heavy", 120, "W")
	pushMany(e, "light", 120, "W")
	c := e.client(Config{Queues: []string{"heavy,3", "light,1"}})
	count := map[string]int{}
	for range 120 {
		j := fetch(t, c, 5*time.Second)
		count[j.Queue]++
		if err := c.Done(context.Background(), j); err != nil {
			t.Fatal(err)
		}
	}
	// heavy comes first with probability 3/4: 90 expected, sd 4.7.
	if count["heavy"] < 70 || count["heavy"] > 108 || count["light"] < 12 {
		t.Fatalf("fetched %v of 120 with weights 3:1", count)
	}
}

func TestReliableFetchDoneRequeue(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	jids := pushMany(e, "work", 2, "W")
	c := e.client(Config{Queues: []string{"work"}})
	ctx := context.Background()
	working := WorkingKey(c.Identity(), "work")

	j := fetch(t, c, 5*time.Second)
	if j.JID != jids[0] {
		t.Fatalf("fetched %s, want the oldest %s", j.JID, jids[0])
	}
	if got := e.lrange(working); !reflect.DeepEqual(got, []string{j.Raw}) {
		t.Fatalf("working list %q, want the fetched job", got)
	}
	if n := e.llen("queue:work"); n != 1 {
		t.Fatalf("queue holds %d", n)
	}
	// Requeue: back at the head of the queue, fetched next, out of the
	// working list.
	if err := c.Requeue(ctx, j); err != nil {
		t.Fatal(err)
	}
	if n := e.llen(working); n != 0 {
		t.Fatalf("working list holds %d after Requeue", n)
	}
	j2 := fetch(t, c, 5*time.Second)
	if j2.JID != jids[0] || j2.Raw != j.Raw {
		t.Fatalf("after Requeue fetched %s, want %s again", j2.JID, jids[0])
	}
	if err := c.Done(ctx, j2); err != nil {
		t.Fatal(err)
	}
	if n := e.llen(working); n != 0 {
		t.Fatalf("working list holds %d after Done", n)
	}
	if err := c.Done(ctx, j2); !errors.Is(err, ErrNotHeld) {
		t.Fatalf("second Done: %v, want ErrNotHeld", err)
	}
	var left []map[string]any
	e.ruby("queue", map[string]any{"queue": "work"}, &left)
	if len(left) != 1 || left[0]["jid"] != jids[1] {
		t.Fatalf("queue as Sidekiq sees it: %v", left)
	}

	// An undecodable element comes back with its error, still held.
	if err := e.rdb.LPush(ctx, "queue:work2", "{not json").Err(); err != nil {
		t.Fatal(err)
	}
	c2 := e.client(Config{Queues: []string{"work2"}})
	fctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	bad, err := c2.Fetch(fctx)
	if !errors.Is(err, ErrBadJSON) || bad == nil || bad.Raw != "{not json" || bad.Queue != "work2" {
		t.Fatalf("Fetch of bad JSON: %+v %v", bad, err)
	}
	if got := e.lrange(WorkingKey(c2.Identity(), "work2")); !reflect.DeepEqual(got, []string{"{not json"}) {
		t.Fatalf("working list %q", got)
	}
	if err := c2.Kill(ctx, bad, "JSON::ParserError", err.Error()); err != nil {
		t.Fatal(err)
	}
	var dead []sortedEntry
	e.ruby("dead", nil, &dead)
	if len(dead) != 1 || dead[0].Value != "{not json" {
		t.Fatalf("dead set %+v", dead)
	}
}

func TestFetchCancelAndActiveJob(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	c := e.client(Config{Queues: []string{"aj"}, FetchTimeout: time.Second})
	ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	defer cancel()
	start := time.Now()
	if _, err := c.Fetch(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Fetch of an empty queue: %v", err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("Fetch returned %v after its context ended", d)
	}

	var out map[string]string
	e.ruby("activejob", map[string]any{"queue": "aj"}, &out)
	j := fetch(t, c, 5*time.Second)
	if !j.Wrapped || j.Class != "ReportJob" || j.JID != out["jid"] {
		t.Fatalf("job %+v, Ruby says %v", j, out)
	}
	want := activeJobWant()
	want[9] = GlobalID("gid://onceler-test/Person/42")
	if !reflect.DeepEqual(j.Args, want) {
		t.Fatalf("args\n%#v\nwant\n%#v", j.Args, want)
	}
	if err := c.Done(context.Background(), j); err != nil {
		t.Fatal(err)
	}
}

func TestRecoverDeadProcess(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	ja := pushMany(e, "qa", 2, "W")
	jb := pushMany(e, "qb", 1, "W")
	// A process that dies without cleaning up: its heartbeat key lives
	// one second.
	dying := e.client(Config{Queues: []string{"qa", "qb"}, Heartbeat: 200 * time.Millisecond, HeartbeatTTL: time.Second})
	for range 3 {
		fetch(t, dying, 5*time.Second)
	}
	if n := e.llen(WorkingKey(dying.Identity(), "qa")) + e.llen(WorkingKey(dying.Identity(), "qb")); n != 3 {
		t.Fatalf("working lists hold %d", n)
	}
	_ = dying.Close()

	c := e.client(Config{Queues: []string{"qa", "qb"}})
	// While its heartbeat lives, nothing is taken from it.
	if n, err := c.RecoverDead(ctx); err != nil || n != 0 {
		t.Fatalf("RecoverDead of a live process: %d %v", n, err)
	}
	eventually(t, 5*time.Second, "the dead process's heartbeat expires", func() bool {
		return e.rdb.Exists(ctx, dying.Identity()).Val() == 0
	})
	stop := e.run(c, nil) // recovers at start
	eventually(t, 5*time.Second, "the jobs are back in their queues", func() bool {
		return e.llen("queue:qa") == 2 && e.llen("queue:qb") == 1
	})
	stop()
	if n := e.llen(WorkingKey(dying.Identity(), "qa")) + e.llen(WorkingKey(dying.Identity(), "qb")); n != 0 {
		t.Fatalf("dead working lists still hold %d", n)
	}
	if e.rdb.HExists(ctx, "onceler:working", dying.Identity()).Val() {
		t.Fatal("dead process still registered")
	}
	// The oldest job of each queue is fetched first again.
	var got []string
	for range 3 {
		j := fetch(t, c, 5*time.Second)
		got = append(got, j.JID)
		if err := c.Done(ctx, j); err != nil {
			t.Fatal(err)
		}
	}
	want := append(append([]string{}, ja...), jb...)
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("recovered jobs fetched %v, want %v", got, want)
	}
	if err := dying.Close(); err != nil {
		t.Logf("second Close: %v", err)
	}
}

func TestRecoverKilledProcess(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	jids := pushMany(e, "killed", 3, "W")
	bin := filepath.Join(t.TempDir(), "fetcher")
	if out, err := exec.Command("go", "build", "-o", bin, "./testdata/fetcher").CombinedOutput(); err != nil {
		t.Fatalf("build fetcher: %v\n%s", err, out)
	}
	cmd := exec.Command(bin, e.url, "killed", "3")
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	sc := bufio.NewScanner(stdout)
	var identity string
	var fetched []string
	for len(fetched) < 3 && sc.Scan() {
		k, v, _ := strings.Cut(sc.Text(), " ")
		switch k {
		case "identity":
			identity = v
		case "fetched":
			fetched = append(fetched, v)
		}
	}
	if !reflect.DeepEqual(fetched, jids) || identity == "" {
		t.Fatalf("child fetched %v (identity %q), want %v", fetched, identity, jids)
	}
	if n := e.llen(WorkingKey(identity, "killed")); n != 3 || e.llen("queue:killed") != 0 {
		t.Fatalf("child's working list holds %d", n)
	}
	var procs []map[string]any
	eventually(t, 5*time.Second, "the child busy in Sidekiq::ProcessSet", func() bool {
		e.ruby("processes", nil, &procs)
		return len(procs) == 1 && procs[0]["identity"] == identity && procs[0]["busy"] == jsonNum(3)
	})
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()

	c := e.client(Config{Queues: []string{"killed"}, RecoverInterval: 200 * time.Millisecond})
	e.run(c, nil)
	eventually(t, 10*time.Second, "the killed process's jobs back in their queue", func() bool {
		return e.llen("queue:killed") == 3
	})
	if n := e.llen(WorkingKey(identity, "killed")); n != 0 {
		t.Fatalf("killed process's working list holds %d", n)
	}
	for _, want := range jids {
		j := fetch(t, c, 5*time.Second)
		if j.JID != want {
			t.Fatalf("fetched %s, want %s", j.JID, want)
		}
		if err := c.Done(ctx, j); err != nil {
			t.Fatal(err)
		}
	}
	// Sidekiq's ProcessSet prunes the dead process once its hash is gone.
	e.ruby("processes", nil, &procs)
	for _, p := range procs {
		if p["identity"] == identity {
			t.Fatalf("killed process still listed: %v", p)
		}
	}
}

func TestRequeueAll(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	a := pushMany(e, "ra", 2, "W")
	b := pushMany(e, "rb", 1, "W")
	c := e.client(Config{Queues: []string{"ra", "rb"}})
	var held []*Job
	for range 3 {
		held = append(held, fetch(t, c, 5*time.Second))
	}
	if n, err := c.RequeueAll(ctx); err != nil || n != 3 {
		t.Fatalf("RequeueAll: %d %v", n, err)
	}
	if e.llen("queue:ra") != 2 || e.llen("queue:rb") != 1 {
		t.Fatal("jobs not back in their queues")
	}
	if err := c.Done(ctx, held[0]); !errors.Is(err, ErrNotHeld) {
		t.Fatalf("Done of a requeued job: %v", err)
	}
	var got []string
	for range 3 {
		j := fetch(t, c, 5*time.Second)
		got = append(got, j.JID)
		if err := c.Done(ctx, j); err != nil {
			t.Fatal(err)
		}
	}
	if want := append(append([]string{}, a...), b...); !reflect.DeepEqual(got, want) {
		t.Fatalf("fetched %v after RequeueAll, want %v", got, want)
	}
	if !e.rdb.HExists(ctx, "onceler:working", c.Identity()).Val() {
		t.Fatal("RequeueAll unregistered the live process")
	}
}

// TestLargeJobThroughSmallBuffers: a job far larger than a connection's
// read and write buffers (connBufferSize) is fetched whole, handed back
// (its payload written again) and fetched whole once more.
func TestLargeJobThroughSmallBuffers(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	big := strings.Repeat("0123456789abcdef", 16*connBufferSize/16) // 16 buffers' worth
	var jid string
	e.ruby("push", map[string]any{"class": "BigWorker", "args": []any{big, 7}, "queue": "big"}, &jid)
	c := e.client(Config{Queues: []string{"big"}})
	check := func(j *Job) {
		t.Helper()
		if j.JID != jid || len(j.Args) != 2 || j.Args[0] != big {
			t.Fatalf("fetched jid %s with %d args (first %d bytes), want %s with the %d-byte string", j.JID, len(j.Args), len(fmt.Sprint(j.Args[0])), jid, len(big))
		}
	}
	j := fetch(t, c, 5*time.Second)
	check(j)
	if err := c.Requeue(context.Background(), j); err != nil {
		t.Fatal(err)
	}
	j = fetch(t, c, 5*time.Second)
	check(j)
	if err := c.Done(context.Background(), j); err != nil {
		t.Fatal(err)
	}
}
