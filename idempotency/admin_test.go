package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
)

func TestMigrateEmptyRepeatAndConcurrent(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t)
	ctx := context.Background()
	schema := testenv.Name("mig")
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+schema+` CASCADE`) })

	// Two processes: two pools, migrating the same (absent) schema at once.
	other, err := pgxpool.New(ctx, testenv.DatabaseURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		p := pool
		if i%2 == 1 {
			p = other
		}
		wg.Go(func() {
			s, err := idempotency.New(p, idempotency.Config{Schema: schema, Batch: idempotency.BatchConfig{Disabled: true}})
			if err != nil {
				errs[i] = err
				return
			}
			defer s.Close()
			errs[i] = s.Migrate(ctx)
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatalf("concurrent migrate: %v", err)
		}
	}
	ms, err := idempotency.Migrations()
	if err != nil || len(ms) == 0 {
		t.Fatalf("migrations %v %v", ms, err)
	}
	count := func() int {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+schema+`.migrations`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := count(); n != len(ms) {
		t.Fatalf("%d migrations recorded, want %d", n, len(ms))
	}
	s, err := idempotency.New(pool, idempotency.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Migrate(ctx); err != nil {
		t.Fatalf("migrate again: %v", err)
	}
	if n := count(); n != len(ms) {
		t.Fatalf("re-migrate changed history: %d", n)
	}
	c, err := s.Claim(ctx, params("t", "k"))
	if err != nil || c.Outcome != idempotency.OutcomeFirst {
		t.Fatalf("claim on migrated schema %+v %v", c, err)
	}
	if _, err := idempotency.New(pool, idempotency.Config{Schema: `bad"name`}); err == nil {
		t.Fatal("accepted a bad schema name")
	}
}

func TestListResolveHeld(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{})
	ctx := context.Background()
	for _, k := range []string{"a", "b", "c"} {
		p := params("wire", k)
		mustClaim(t, e.store, p, idempotency.OutcomeFirst)
		e.expire(t, "wire", k)
		st := mustClaim(t, e.store, p, idempotency.OutcomeStale)
		if err := e.store.Hold(ctx, p.Ref(st.Token), []byte("msg-"+k), "crashed"); err != nil {
			t.Fatal(err)
		}
	}
	p := params("wire", "done")
	c := mustClaim(t, e.store, p, idempotency.OutcomeFirst)
	if _, err := e.store.Complete(ctx, p.Ref(c.Token), nil); err != nil {
		t.Fatal(err)
	}
	held, err := e.store.List(ctx, idempotency.Filter{Task: "wire", Status: idempotency.StatusHeld})
	if err != nil || len(held) != 3 || held[0].Key != "a" || held[0].Reason != "crashed" || string(held[0].Message) != "msg-a" {
		t.Fatalf("held %+v %v", held, err)
	}
	page, err := e.store.List(ctx, idempotency.Filter{Task: "wire", AfterTask: "wire", AfterKey: "b", Limit: 1})
	if err != nil || len(page) != 1 || page[0].Key != "c" {
		t.Fatalf("page %+v %v", page, err)
	}
	if err := e.store.ResolveCompleted(ctx, "wire", "a", []byte(`{"by":"ops"}`)); err != nil {
		t.Fatal(err)
	}
	mustClaim(t, e.store, params("wire", "a"), idempotency.OutcomeCompleted)
	msg, err := e.store.ResolveRetry(ctx, "wire", "b")
	if err != nil || string(msg) != "msg-b" {
		t.Fatalf("resolve retry %q %v", msg, err)
	}
	c = mustClaim(t, e.store, params("wire", "b"), idempotency.OutcomeFirst)
	if c.Attempt != 2 {
		t.Fatalf("attempt %d", c.Attempt)
	}
	if err := e.store.ResolveCompleted(ctx, "wire", "done", nil); !errors.Is(err, idempotency.ErrNotHeld) {
		t.Fatalf("resolve completed record: %v", err)
	}
	if _, err := e.store.ResolveRetry(ctx, "wire", "nope"); !errors.Is(err, idempotency.ErrNotFound) {
		t.Fatalf("resolve missing: %v", err)
	}
	if st := repeatsFor(t, e, "wire"); st.Held != 3 {
		t.Fatalf("repeats %+v", st)
	}
}

func TestRepeatsReport(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{})
	ctx := context.Background()
	before := time.Now().Add(-time.Second)
	p := params("a", "1")
	c := mustClaim(t, e.store, p, idempotency.OutcomeFirst)
	mustClaim(t, e.store, p, idempotency.OutcomeInProgress)
	if err := e.store.Fail(ctx, p.Ref(c.Token), "x"); err != nil {
		t.Fatal(err)
	}
	c = mustClaim(t, e.store, p, idempotency.OutcomeFirst)
	if _, err := e.store.Complete(ctx, p.Ref(c.Token), nil); err != nil {
		t.Fatal(err)
	}
	mustClaim(t, e.store, p, idempotency.OutcomeCompleted)
	bad := p
	bad.Fingerprint = []byte("other")
	mustClaim(t, e.store, bad, idempotency.OutcomeMismatch)
	q := params("b", "1")
	mustClaim(t, e.store, q, idempotency.OutcomeFirst)
	e.expire(t, "b", "1")
	st := mustClaim(t, e.store, q, idempotency.OutcomeStale)
	if err := e.store.Skip(ctx, q.Ref(st.Token), "policy"); err != nil {
		t.Fatal(err)
	}
	rs, err := e.store.Repeats(ctx, before)
	if err != nil {
		t.Fatal(err)
	}
	want := []idempotency.RepeatStats{
		{Task: "a", Duplicates: 2, Mismatches: 1, Failures: 1},
		{Task: "b", Skipped: 1},
	}
	if fmt.Sprint(rs) != fmt.Sprint(want) {
		t.Fatalf("repeats %+v, want %+v", rs, want)
	}
	if rs, err := e.store.Repeats(ctx, time.Now().Add(time.Hour)); err != nil || len(rs) != 0 {
		t.Fatalf("future range %+v %v", rs, err)
	}
}

func TestPurgeBoundedNeverClaimedOrHeld(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{})
	ctx := context.Background()
	const done = 25
	for i := range done {
		e.finish(t, params("old", fmt.Sprint("c", i)), i)
	}
	claimed := params("old", "claimed")
	mustClaim(t, e.store, claimed, idempotency.OutcomeFirst)
	heldP := params("old", "held")
	c := mustClaim(t, e.store, heldP, idempotency.OutcomeFirst)
	e.expire(t, "old", "held") // a claim is held once its lease has lapsed
	if err := e.store.Hold(ctx, heldP.Ref(c.Token), nil, "x"); err != nil {
		t.Fatal(err)
	}
	// Everything is old now, and one completed record is recent.
	if _, err := e.pool.Exec(ctx, `UPDATE `+e.schema+`.records SET updated_at = now() - interval '40 days'`); err != nil {
		t.Fatal(err)
	}
	recent := params("old", "recent")
	c = mustClaim(t, e.store, recent, idempotency.OutcomeFirst)
	if _, err := e.store.Complete(ctx, recent.Ref(c.Token), nil); err != nil {
		t.Fatal(err)
	}
	cutoff := time.Now().Add(-30 * 24 * time.Hour)

	res, err := e.store.Purge(ctx, idempotency.PurgeParams{Before: cutoff, BatchSize: 10, MaxBatches: 2})
	if err != nil {
		t.Fatal(err)
	}
	if res.Records != 20 {
		t.Fatalf("bounded purge deleted %d records, want 20", res.Records)
	}
	res, err = e.store.Purge(ctx, idempotency.PurgeParams{Before: cutoff, BatchSize: 10})
	if err != nil {
		t.Fatal(err)
	}
	if res.Records != 5 {
		t.Fatalf("second purge deleted %d, want 5", res.Records)
	}
	left, err := e.store.List(ctx, idempotency.Filter{Task: "old"})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]idempotency.Status{}
	for _, r := range left {
		got[r.Key] = r.Status
	}
	want := map[string]idempotency.Status{"claimed": idempotency.StatusClaimed, "held": idempotency.StatusHeld, "recent": idempotency.StatusCompleted}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("left %v, want %v", got, want)
	}
	if _, err := e.store.Purge(ctx, idempotency.PurgeParams{}); err == nil {
		t.Fatal("purge without a cutoff")
	}
}
