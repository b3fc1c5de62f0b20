package tasks

import (
	"context"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/testenv"
)

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

// TestDjangoChordBadSubTasks: a chord counter row whose sub_tasks is not a
// JSON list of result tuples can never be joined: the error is permanent,
// and the worker's chord step stops on it instead of retrying for ever.
func TestDjangoChordBadSubTasks(t *testing.T) {
	raw := testenv.DatabaseURL(t)
	pool := testenv.Pool(t)
	schema := testenv.Schema(t, pool)
	ctx := context.Background()
	for _, q := range []string{
		`CREATE TABLE ` + schema + `.` + DjangoTaskTable + ` (id serial PRIMARY KEY, task_id varchar(255) UNIQUE NOT NULL,
			status varchar(50), content_type varchar(128), content_encoding varchar(64), result text, date_done timestamptz,
			traceback text, meta text, task_args text, task_kwargs text, task_name varchar(255), worker varchar(100),
			date_created timestamptz, periodic_task_name varchar(255))`,
		`CREATE TABLE ` + schema + `.` + DjangoChordTable + ` (id serial PRIMARY KEY, group_id varchar(255) UNIQUE NOT NULL,
			sub_tasks text NOT NULL, count integer NOT NULL)`,
		`INSERT INTO ` + schema + `.` + DjangoChordTable + ` (group_id, sub_tasks, count) VALUES ('g-bad', '{"not": "a list"}', 1)`,
	} {
		if _, err := pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	qs := u.Query()
	qs.Set("search_path", schema)
	u.RawQuery = qs.Encode()
	b, err := newBackend(&Config{ResultBackend: "django-db+" + u.String()})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = b.close() }()
	cb := b.(chordBackend)
	for i := range 2 {
		_, _, err := cb.chordPart(ctx, "g-bad", "part-1", nil, nil)
		if err == nil {
			t.Fatalf("call %d: chordPart of a counter whose sub_tasks is not a list: no error", i)
		}
		if !b.permanent(err) {
			t.Errorf("call %d: %v: permanent() = false; the same error comes on every retry", i, err)
		}
	}
}
