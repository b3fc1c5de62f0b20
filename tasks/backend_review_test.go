package tasks

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/testenv"
)

// TestReviewRedisResultOverBulkLimit: a result longer than the Redis
// server's proto-max-bulk-len (here 1 MB, a documented setting) is refused
// by the server on every write, whatever the retry. The backend must call
// that error permanent; when it does not, storeResult retries it for ever
// and the delivery is held unacknowledged for ever, its caller never
// answered.
func TestReviewRedisResultOverBulkLimit(t *testing.T) {
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
