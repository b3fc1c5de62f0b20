package sidekiq

import (
	"context"
	"testing"
	"time"
)

// TestHeld: a job is held until its process's working lists are
// recovered (here by RequeueAll); its new fetch is held, the old one not.
func TestHeld(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	if err := e.rdb.LPush(ctx, "queue:h", `{"class":"H","args":[],"jid":"0123456789abcdef0123abcd","queue":"h"}`).Err(); err != nil {
		t.Fatal(err)
	}
	c := e.client(Config{Queues: []string{"h"}})
	old := fetch(t, c, 5*time.Second)
	if held, err := c.Held(ctx, []*Job{old, {Raw: "{}", Queue: "h"}}); err != nil || !held[0] || !held[1] {
		t.Fatalf("Held after the fetch: %v, %v; want [true true] (a Job not made by Fetch reads true)", held, err)
	}
	if n, err := c.RequeueAll(ctx); err != nil || n != 1 {
		t.Fatalf("RequeueAll: %d, %v", n, err)
	}
	if held, err := c.Held(ctx, []*Job{old}); err != nil || held[0] {
		t.Fatalf("Held after RequeueAll: %v, %v; want [false]", held, err)
	}
	again := fetch(t, c, 5*time.Second)
	held, err := c.Held(ctx, []*Job{old, again})
	if err != nil || held[0] || !held[1] {
		t.Fatalf("Held after a new fetch of the job: %v, %v; want [false true]", held, err)
	}
	if err := c.Done(ctx, again); err != nil {
		t.Fatal(err)
	}
}
