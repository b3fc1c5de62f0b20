package main

import (
	"context"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// batchTracer times the pgx batches (the record's group-commit flushes) and
// the single statements of the worker's pool, for -debug.
type batchTracer struct {
	mu      sync.Mutex
	batches []time.Duration
	sizes   []int
	queries int
	qTime   time.Duration
}

type traceStart struct{}

func (t *batchTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	t.mu.Lock()
	t.sizes = append(t.sizes, d.Batch.Len())
	t.mu.Unlock()
	return context.WithValue(ctx, traceStart{}, time.Now())
}

func (t *batchTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (t *batchTracer) TraceBatchEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchEndData) {
	if s, ok := ctx.Value(traceStart{}).(time.Time); ok {
		t.mu.Lock()
		t.batches = append(t.batches, time.Since(s))
		t.mu.Unlock()
	}
}

func (t *batchTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return context.WithValue(ctx, traceStart{}, time.Now())
}

func (t *batchTracer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	if s, ok := ctx.Value(traceStart{}).(time.Time); ok {
		t.mu.Lock()
		t.queries++
		t.qTime += time.Since(s)
		t.mu.Unlock()
	}
}

// summary returns the flush count, mean and p99 flush time in ms, and the
// single statements' count and mean time in ms.
func (t *batchTracer) summary() map[string]float64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := map[string]float64{"pg_batches": float64(len(t.batches)), "pg_queries": float64(t.queries)}
	if n := len(t.batches); n > 0 {
		var sum time.Duration
		s := append([]time.Duration(nil), t.batches...)
		for _, d := range s {
			sum += d
		}
		sortDurations(s)
		out["pg_batch_mean_ms"] = float64(sum.Microseconds()) / 1000 / float64(n)
		out["pg_batch_p99_ms"] = float64(percentile(s, 0.99).Microseconds()) / 1000
	}
	if t.queries > 0 {
		out["pg_query_mean_ms"] = float64(t.qTime.Microseconds()) / 1000 / float64(t.queries)
	}
	return out
}
