package idempotency_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
)

// BenchmarkClaimComplete measures claim+complete of distinct operations,
// batched (group commit) and one statement at a time, with 1, 16 and 256
// concurrent callers on a pool of 16 connections. It reports operations per
// second, the p99 latency of one claim+complete, and commits per operation
// (flushes per operation when batched; two when not).
func BenchmarkClaimComplete(b *testing.B) {
	for _, mode := range []string{"batched", "unbatched"} {
		for _, callers := range []int{1, 16, 256} {
			b.Run(fmt.Sprintf("%s/callers=%d", mode, callers), func(b *testing.B) {
				benchClaimComplete(b, mode == "unbatched", callers)
			})
		}
	}
}

func benchClaimComplete(b *testing.B, disabled bool, callers int) {
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(testenv.DatabaseURL(b))
	if err != nil {
		b.Fatal(err)
	}
	cfg.MaxConns = 16
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer pool.Close()
	schema := testenv.Schema(b, pool)
	s, err := idempotency.New(pool, idempotency.Config{Schema: schema, Batch: idempotency.BatchConfig{Disabled: disabled}})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	if err := s.Migrate(ctx); err != nil {
		b.Fatal(err)
	}
	run := fmt.Sprint(time.Now().UnixNano())
	var next atomic.Int64
	lat := make([][]time.Duration, callers)
	b.ResetTimer()
	start := time.Now()
	var wg sync.WaitGroup
	for w := range callers {
		wg.Go(func() {
			for {
				i := next.Add(1)
				if i > int64(b.N) {
					return
				}
				t0 := time.Now()
				p := idempotency.ClaimParams{
					Task: "bench", Key: run + "-" + fmt.Sprint(i), Fingerprint: []byte("0123456789abcdef0123456789abcdef"),
					Owner: "bench", TaskID: fmt.Sprint(i), Lease: time.Minute,
				}
				c, err := s.Claim(ctx, p)
				if err != nil || c.Outcome != idempotency.OutcomeFirst {
					b.Errorf("claim: %v %v", c.Outcome, err)
					return
				}
				if err := s.Complete(ctx, p.Ref(c.Token), []byte(`{"ok":true}`)); err != nil {
					b.Errorf("complete: %v", err)
					return
				}
				lat[w] = append(lat[w], time.Since(t0))
			}
		})
	}
	wg.Wait()
	el := time.Since(start)
	b.StopTimer()
	all := slices.Concat(lat...)
	slices.Sort(all)
	b.ReportMetric(float64(b.N)/el.Seconds(), "ops/s")
	if len(all) > 0 {
		b.ReportMetric(float64(all[len(all)*99/100].Microseconds())/1000, "p99-ms")
	}
	commits := float64(2 * b.N)
	if !disabled {
		commits = float64(s.BatchStats().Flushes)
	}
	b.ReportMetric(commits/float64(b.N), "commits/op")
}
