package idempotency_test

import (
	"context"
	"fmt"
	"reflect"
	"testing"
	"time"

	"github.com/onceler/onceler/idempotency"
)

// finish claims p and ends the claim by i: completed, failed or skipped in
// turn. It returns the record's status.
func (e *env) finish(t *testing.T, p idempotency.ClaimParams, i int) idempotency.Status {
	t.Helper()
	ctx := context.Background()
	c := mustClaim(t, e.store, p, idempotency.OutcomeFirst)
	var err error
	var st idempotency.Status
	switch i % 3 {
	case 0:
		_, err = e.store.Complete(ctx, p.Ref(c.Token), nil)
		st = idempotency.StatusCompleted
	case 1:
		err, st = e.store.Fail(ctx, p.Ref(c.Token), "x"), idempotency.StatusFailed
	default:
		e.expire(t, p.Task, p.Key)
		err, st = e.store.Skip(ctx, p.Ref(c.Token), "policy"), idempotency.StatusSkipped
	}
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// TestPurgeDryRunCountsWhatPurgeDeletes: a dry run deletes nothing, never
// counts claimed or held records, and counts exactly what the real purge
// then deletes, per task and status, with or without MaxBatches; Progress
// reports the running totals.
func TestPurgeDryRunCountsWhatPurgeDeletes(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{})
	ctx := context.Background()
	for i := range 17 {
		task := []string{"purge.a", "purge.b"}[i%2]
		p := params(task, fmt.Sprint("k", i))
		if e.finish(t, p, i) == idempotency.StatusCompleted {
			mustClaim(t, e.store, p, idempotency.OutcomeCompleted) // a duplicate: one repeat event
		}
	}
	mustClaim(t, e.store, params("purge.a", "claimed"), idempotency.OutcomeFirst)
	heldP := params("purge.b", "held")
	c := mustClaim(t, e.store, heldP, idempotency.OutcomeFirst)
	e.expire(t, "purge.b", "held") // a claim is held once its lease has lapsed
	if err := e.store.Hold(ctx, heldP.Ref(c.Token), nil, "x"); err != nil {
		t.Fatal(err)
	}
	for _, table := range []string{"records SET updated_at", "events SET at"} {
		if _, err := e.pool.Exec(ctx, `UPDATE `+e.schema+`.`+table+` = now() - interval '2 days'`); err != nil {
			t.Fatal(err)
		}
	}
	recent := params("purge.a", "recent")
	c = mustClaim(t, e.store, recent, idempotency.OutcomeFirst)
	if _, err := e.store.Complete(ctx, recent.Ref(c.Token), nil); err != nil {
		t.Fatal(err)
	}
	mustClaim(t, e.store, recent, idempotency.OutcomeCompleted) // a recent event
	records := func() int { return e.count(t, `SELECT count(*) FROM `+e.schema+`.records`) }
	events := func() int { return e.count(t, `SELECT count(*) FROM `+e.schema+`.events`) }
	before := time.Now().Add(-24 * time.Hour)
	oldEvents := int64(e.count(t, `SELECT count(*) FROM `+e.schema+`.events WHERE at < $1`, before))
	allEvents := events()
	if oldEvents < 6 || allEvents != int(oldEvents)+1 {
		t.Fatalf("%d old events of %d, want at least the 6 duplicates, and one recent", oldEvents, allEvents)
	}

	dry, err := e.store.Purge(ctx, idempotency.PurgeParams{Before: before, DryRun: true, Progress: func(idempotency.PurgeResult) {
		t.Error("Progress called by a dry run")
	}})
	if err != nil {
		t.Fatal(err)
	}
	want := []idempotency.PurgeCount{
		{Task: "purge.a", Status: idempotency.StatusCompleted, Records: 3},
		{Task: "purge.a", Status: idempotency.StatusFailed, Records: 3},
		{Task: "purge.a", Status: idempotency.StatusSkipped, Records: 3},
		{Task: "purge.b", Status: idempotency.StatusCompleted, Records: 3},
		{Task: "purge.b", Status: idempotency.StatusFailed, Records: 3},
		{Task: "purge.b", Status: idempotency.StatusSkipped, Records: 2},
	}
	if dry.Records != 17 || dry.Events != oldEvents || dry.Batches != 0 || !reflect.DeepEqual(dry.Counts, want) {
		t.Fatalf("dry run %+v, want 17 records (%v) and %d events", dry, want, oldEvents)
	}
	if records() != 20 || events() != allEvents {
		t.Fatalf("dry run deleted: %d records, %d events left", records(), events())
	}

	// Bounded: the dry run counts the rows the bounded purge deletes.
	bounded := idempotency.PurgeParams{Before: before, BatchSize: 4, MaxBatches: 2}
	bounded.DryRun = true
	dryBounded, err := e.store.Purge(ctx, bounded)
	if err != nil {
		t.Fatal(err)
	}
	bounded.DryRun = false
	var progress []idempotency.PurgeResult
	bounded.Progress = func(r idempotency.PurgeResult) { progress = append(progress, r) }
	got, err := e.store.Purge(ctx, bounded)
	if err != nil {
		t.Fatal(err)
	}
	if got.Records != 8 || got.Events != 8 || dryBounded.Records != got.Records || dryBounded.Events != got.Events ||
		!reflect.DeepEqual(dryBounded.Counts, got.Counts) {
		t.Fatalf("bounded: dry run %+v, purge %+v; want the same 8 records and 8 events", dryBounded, got)
	}
	wantProgress := []idempotency.PurgeResult{{Records: 4, Batches: 1}, {Records: 8, Batches: 2}, {Records: 8, Events: 4, Batches: 3}, {Records: 8, Events: 8, Batches: 4}}
	if !reflect.DeepEqual(progress, wantProgress) {
		t.Fatalf("progress %+v, want %+v", progress, wantProgress)
	}

	// The rest: dry run, then the purge deletes exactly that.
	dry, err = e.store.Purge(ctx, idempotency.PurgeParams{Before: before, DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	got, err = e.store.Purge(ctx, idempotency.PurgeParams{Before: before, BatchSize: 3})
	if err != nil {
		t.Fatal(err)
	}
	if dry.Records != 9 || got.Records != dry.Records || dry.Events != oldEvents-8 || got.Events != dry.Events ||
		!reflect.DeepEqual(dry.Counts, got.Counts) {
		t.Fatalf("rest: dry run %+v, purge %+v; want the same 9 records and %d events", dry, got, oldEvents-8)
	}
	if records() != 3 || events() != 1 {
		t.Fatalf("%d records and %d events left, want 3 (claimed, held, recent) and 1", records(), events())
	}
	for _, k := range []struct{ task, key string }{{"purge.a", "claimed"}, {"purge.b", "held"}, {"purge.a", "recent"}} {
		e.get(t, k.task, k.key)
	}
	dry, err = e.store.Purge(ctx, idempotency.PurgeParams{Before: before, DryRun: true})
	if err != nil || dry.Records != 0 || dry.Events != 0 || len(dry.Counts) != 0 {
		t.Fatalf("dry run after purge %+v %v, want nothing", dry, err)
	}
}
