package idempotency_test

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/onceler/onceler/idempotency"
)

// Claims and completions written together in batches keep every string as
// it was given: quotes, braces, commas, backslashes, NULL, non-ASCII.
func TestBatchKeepsEveryString(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{})
	odd := []string{`a"b`, `{x,y}`, `c,d`, `back\slash`, `NULL`, `null`, `é ünï`, ` spaced `, `'single'`, "tab\there", `[1]`, `()`}
	var keys []string
	for i := range 4 {
		for _, o := range odd {
			keys = append(keys, fmt.Sprintf("%s-%d", o, i))
		}
	}
	ctx := context.Background()
	run := func(f func(key string)) {
		var wg sync.WaitGroup
		start := make(chan struct{})
		for _, k := range keys {
			wg.Go(func() { <-start; f(k) })
		}
		close(start)
		wg.Wait()
	}
	claims := make(map[string]idempotency.Claim, len(keys))
	var mu sync.Mutex
	before := e.store.BatchStats()
	run(func(k string) {
		p := params("odd "+k, k)
		p.Owner, p.TaskID = "owner "+k, "id "+k
		c, err := e.store.Claim(ctx, p)
		if err != nil {
			t.Error(err)
			return
		}
		mu.Lock()
		claims[k] = c
		mu.Unlock()
	})
	run(func(k string) {
		mu.Lock()
		c := claims[k]
		mu.Unlock()
		res := fmt.Sprintf(`{"k":%q}`, k)
		if _, err := e.store.Complete(ctx, params("odd "+k, k).Ref(c.Token), []byte(res)); err != nil {
			t.Errorf("complete %q: %v", k, err)
		}
	})
	after := e.store.BatchStats()
	if ops, flushes := after.Ops-before.Ops, after.Flushes-before.Flushes; flushes >= ops {
		t.Errorf("%d calls in %d flushes: none batched", ops, flushes)
	}
	for _, k := range keys {
		if c := claims[k]; c.Outcome != idempotency.OutcomeFirst || c.Owner != "owner "+k || c.TaskID != "id "+k {
			t.Errorf("claim %q: %+v", k, c)
		}
		r := e.get(t, "odd "+k, k)
		if r.Status != idempotency.StatusCompleted || r.Owner != "owner "+k || r.TaskID != "id "+k || r.Token != claims[k].Token {
			t.Errorf("record %q: %+v", k, r)
		}
	}
}
