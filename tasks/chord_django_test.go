package tasks

import (
	"context"
	"fmt"
	"net/url"
	"testing"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/testenv"
)

// TestDjangoChordCounter: the counter row counts parts down; at 0 the body
// waits until every header part's row is ready, then the part publishes
// it with the results in sub_tasks order, again on a redelivery until the
// chord is done, and never after; without a counter row nothing is
// published.
func TestDjangoChordCounter(t *testing.T) {
	t.Parallel()
	a := newDjangoApp(t, true)
	b := a.openBackend()
	ctx := context.Background()
	gid := testenv.Name("chord")
	if _, err := b.pool.Exec(ctx, `INSERT INTO `+DjangoChordTable+` (group_id, sub_tasks, count) VALUES ($1, $2, 2)`,
		gid, `[[["pa", null], null], [["pb", null], null]]`); err != nil {
		t.Fatal(err)
	}
	store := func(id, status, result string) {
		t.Helper()
		if err := b.put(ctx, id, fmt.Appendf(nil, `{"status": %q, "result": %s, "traceback": null, "children": []}`, status, result)); err != nil {
			t.Fatal(err)
		}
	}
	part := func(id string, want bool) {
		t.Helper()
		fire, joined, err := b.chordPart(ctx, gid, id, nil, nil)
		if err != nil || fire != want {
			t.Fatalf("part %s: fire %v, %v; want %v", id, fire, err, want)
		}
		if fire && (len(joined) != 2 || string(joined[0]) != `[1, "pa", "SUCCESS", 1]` ||
			string(joined[1]) != `[1, "pb", "FAILURE", {"exc_type": "ValueError", "exc_message": ["x"], "exc_module": "builtins"}]`) {
			t.Fatalf("joined %q, want pa's then pb's", joined)
		}
		if fire {
			if p, err := celeryproto.DecodeChordPart("json", joined[1]); err != nil || !p.Propagates() || p.ExceptionRepr() != "ValueError('x')" {
				t.Fatalf("pb's entry read back as %+v, %v", p, err)
			}
		}
	}
	store("pb", "FAILURE", `{"exc_type": "ValueError", "exc_message": ["x"], "exc_module": "builtins"}`)
	part("pb", false) // count 1
	part("pb", false) // its redelivery counts again: 0, but pa is not ready
	store("pa", "SUCCESS", "1")
	part("pa", true) // 0 and all ready
	part("pa", true) // its redelivery, before the chord is done
	if err := b.chordDone(ctx, gid); err != nil {
		t.Fatal(err)
	}
	part("pa", false) // after it: no counter row
}

// TestDjangoChordBadSubTasks: a chord counter row whose sub_tasks is not a
// JSON list of result tuples can never be joined: the error is permanent,
// and the worker's chord step stops on it instead of retrying for ever.
func TestDjangoChordBadSubTasks(t *testing.T) {
	t.Parallel()
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
