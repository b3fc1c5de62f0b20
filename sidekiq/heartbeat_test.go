package sidekiq

import (
	"context"
	"errors"
	"os"
	"reflect"
	"sync"
	"testing"
	"time"
)

func TestHeartbeatSeenBySidekiq(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	jids := pushMany(e, "hb", 3, "BusyWorker")
	c := e.client(Config{Queues: []string{"hb", "other,2"}, Concurrency: 7, Tag: "billing",
		Labels: []string{"blue"}, Heartbeat: 100 * time.Millisecond})
	stop := e.run(c, nil)

	var procs []map[string]any
	eventually(t, 5*time.Second, "the process in Sidekiq::ProcessSet", func() bool {
		e.ruby("processes", nil, &procs)
		return len(procs) == 1
	})
	p := procs[0]
	host, _ := os.Hostname()
	if p["identity"] != c.Identity() || p["hostname"] != host || p["tag"] != "billing" ||
		p["concurrency"] != jsonNum(7) || p["pid"] != jsonNum(os.Getpid()) || p["busy"] != jsonNum(0) ||
		p["quiet"] != "false" || !reflect.DeepEqual(p["queues"], []any{"hb", "other"}) ||
		!reflect.DeepEqual(p["labels"], []any{"blue"}) || p["started_at"] == nil {
		t.Fatalf("process %v", p)
	}
	if beat := num(t, p["beat"]); time.Since(time.Unix(int64(beat), 0)) > 10*time.Second {
		t.Fatalf("beat %v", beat)
	}

	j := fetch(t, c, 5*time.Second)
	c.Begin(j)
	eventually(t, 5*time.Second, "busy 1 in Sidekiq::ProcessSet", func() bool {
		e.ruby("processes", nil, &procs)
		return len(procs) == 1 && procs[0]["busy"] == jsonNum(1)
	})
	var workers []struct {
		Process string         `json:"process"`
		TID     string         `json:"tid"`
		Work    map[string]any `json:"work"`
	}
	e.ruby("workers", nil, &workers)
	if len(workers) != 1 || workers[0].Process != c.Identity() || workers[0].Work["queue"] != "hb" {
		t.Fatalf("Sidekiq::Workers %+v", workers)
	}
	payload, _ := workers[0].Work["payload"].(map[string]any)
	if payload["jid"] != jids[0] || payload["class"] != "BusyWorker" || workers[0].Work["run_at"] == nil {
		t.Fatalf("worker payload %v", workers[0].Work)
	}
	c.End(j, true)
	j2 := fetch(t, c, 5*time.Second)
	c.Begin(j2)
	c.End(j2, false)
	for _, j := range []*Job{j, j2} {
		if err := c.Done(ctx, j); err != nil {
			t.Fatal(err)
		}
	}
	var stats map[string]any
	eventually(t, 5*time.Second, "the counts in Sidekiq::Stats", func() bool {
		e.ruby("stats", nil, &stats)
		return stats["processed"] == jsonNum(2) && stats["failed"] == jsonNum(1)
	})
	if stats["processes_size"] != jsonNum(1) || stats["workers_size"] != jsonNum(0) {
		t.Fatalf("stats %v", stats)
	}
	today := time.Now().UTC().Format(time.DateOnly)
	if v := e.rdb.Get(ctx, "stat:processed:"+today).Val(); v != "2" {
		t.Fatalf("stat:processed:%s = %q", today, v)
	}
	if v := e.rdb.Get(ctx, "stat:failed:"+today).Val(); v != "1" {
		t.Fatalf("stat:failed:%s = %q", today, v)
	}
	if ttl := e.rdb.TTL(ctx, c.Identity()).Val(); ttl <= 0 || ttl > time.Minute {
		t.Fatalf("heartbeat key TTL %v", ttl)
	}

	// Counts taken after the last heartbeat are written when Run stops, and
	// the process leaves "processes".
	j3 := fetch(t, c, 5*time.Second)
	c.Begin(j3)
	c.End(j3, false)
	if err := c.Done(ctx, j3); err != nil {
		t.Fatal(err)
	}
	stop()
	e.ruby("stats", nil, &stats)
	if stats["processed"] != jsonNum(3) {
		t.Fatalf("stats after stop %v", stats)
	}
	if e.rdb.SIsMember(ctx, "processes", c.Identity()).Val() {
		t.Fatal("process still in processes after Run stopped")
	}
}

func TestSignals(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	c := e.client(Config{Queues: []string{"sig"}, Heartbeat: 100 * time.Millisecond})
	var mu sync.Mutex
	var got []string
	e.run(c, func(sig string) {
		mu.Lock()
		defer mu.Unlock()
		got = append(got, sig)
	})
	signals := func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), got...)
	}
	if c.Quiet() {
		t.Fatal("quiet at start")
	}
	e.ruby("signal", map[string]any{"identity": c.Identity(), "signal": "TSTP"}, nil)
	eventually(t, 5*time.Second, "TSTP makes the process quiet", c.Quiet)
	eventually(t, 5*time.Second, "TSTP reaches the callback", func() bool {
		return reflect.DeepEqual(signals(), []string{"TSTP"})
	})
	var procs []map[string]any
	eventually(t, 5*time.Second, "quiet in Sidekiq::ProcessSet", func() bool {
		e.ruby("processes", nil, &procs)
		return len(procs) == 1 && procs[0]["quiet"] == "true"
	})
	pushMany(e, "sig", 1, "W")
	fctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	if j, err := c.Fetch(fctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Fetch while quiet: %+v %v", j, err)
	}
	if n := e.llen("queue:sig"); n != 1 {
		t.Fatalf("queue holds %d while quiet", n)
	}
	e.ruby("signal", map[string]any{"identity": c.Identity(), "signal": "TERM"}, nil)
	eventually(t, 5*time.Second, "TERM reaches the callback", func() bool {
		return reflect.DeepEqual(signals(), []string{"TSTP", "TERM"})
	})
}
