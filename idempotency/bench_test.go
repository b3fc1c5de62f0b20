package idempotency_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
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

// BenchmarkClaimCompleteRate offers claim+complete at a fixed rate (open
// loop, 256 callers, batched) and reports the p99 latency measured from each
// operation's scheduled start, so a stall is not hidden by callers waiting.
func BenchmarkClaimCompleteRate(b *testing.B) {
	for _, rate := range []int{2000, 4500} {
		b.Run(fmt.Sprintf("rate=%d", rate), func(b *testing.B) {
			s, run := benchStore(b, false)
			interval := time.Second / time.Duration(rate)
			all := drive(b, 256, func(start time.Time, i int64) time.Time {
				return start.Add(time.Duration(i) * interval)
			}, claimCompleteOp(s, run, 0))
			if len(all) > 0 {
				b.ReportMetric(float64(all[len(all)/2].Microseconds())/1000, "p50-ms")
			}
			b.ReportMetric(float64(s.BatchStats().Flushes)/float64(b.N), "commits/op")
		})
	}
}

// claimCompleteOp returns claimComplete of operation from+i as an op of
// runOps.
func claimCompleteOp(s *idempotency.Store, run string, from int64) func(context.Context, int64) error {
	return func(ctx context.Context, i int64) error { return claimComplete(ctx, s, run, from+i) }
}

func claimComplete(ctx context.Context, s *idempotency.Store, run string, i int64) error {
	p := idempotency.ClaimParams{
		Task: "bench", Key: run + "-" + fmt.Sprint(i), Fingerprint: []byte("0123456789abcdef0123456789abcdef"),
		Owner: "bench", TaskID: fmt.Sprint(i), Lease: time.Minute,
	}
	c, err := s.Claim(ctx, p)
	if err != nil || c.Outcome != idempotency.OutcomeFirst {
		return fmt.Errorf("claim: %v %v", c.Outcome, err)
	}
	if _, err := s.Complete(ctx, p.Ref(c.Token), []byte(`{"ok":true}`)); err != nil {
		return fmt.Errorf("complete: %w", err)
	}
	return nil
}

// benchStore opens a store on its own pool of 16 connections, in a fresh
// schema, and returns a prefix for unique keys.
func benchStore(b *testing.B, disabled bool) (*idempotency.Store, string) {
	_, _, s := ownPoolStore(b, 16, idempotency.BatchConfig{Disabled: disabled})
	return s, fmt.Sprint(time.Now().UnixNano())
}

// ownPoolStore opens a pool of conns connections of its own and a migrated
// store on it, in a fresh schema; both close when the test ends.
func ownPoolStore(tb testing.TB, conns int32, batch idempotency.BatchConfig) (*pgxpool.Pool, string, *idempotency.Store) {
	tb.Helper()
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(testenv.DatabaseURL(tb))
	if err != nil {
		tb.Fatal(err)
	}
	cfg.MaxConns = conns
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(pool.Close)
	schema := testenv.Schema(tb, pool)
	s, err := idempotency.New(pool, idempotency.Config{Schema: schema, Batch: batch})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(s.Close)
	if err := s.Migrate(ctx); err != nil {
		tb.Fatal(err)
	}
	return pool, schema, s
}

func benchClaimComplete(b *testing.B, disabled bool, callers int) {
	s, run := benchStore(b, disabled)
	drive(b, callers, nil, claimCompleteOp(s, run, 0))
	commits := float64(2 * b.N)
	if !disabled {
		commits = float64(s.BatchStats().Flushes)
	}
	b.ReportMetric(commits/float64(b.N), "commits/op")
}

// drive runs op on operations 1..b.N on callers goroutines, timed, and
// reports operations per second and the p99 latency. due says when
// operation i is due (open loop: a caller waits for it, and its latency
// counts from then); nil: as soon as a caller is free. It returns the
// latencies, sorted.
func drive(b *testing.B, callers int, due func(start time.Time, i int64) time.Time, op func(context.Context, int64) error) []time.Duration {
	b.ResetTimer()
	el, all := runOps(b, callers, int64(b.N), due, op)
	b.StopTimer()
	b.ReportMetric(float64(b.N)/el.Seconds(), "ops/s")
	if len(all) > 0 {
		b.ReportMetric(float64(all[len(all)*99/100].Microseconds())/1000, "p99-ms")
	}
	return all
}

// runOps runs op on operations 1..n on callers goroutines and returns how
// long they took and their latencies, sorted.
func runOps(b *testing.B, callers int, n int64, due func(start time.Time, i int64) time.Time, op func(context.Context, int64) error) (time.Duration, []time.Duration) {
	ctx := context.Background()
	var next atomic.Int64
	lat := make([][]time.Duration, callers)
	start := time.Now()
	var wg sync.WaitGroup
	for w := range callers {
		wg.Go(func() {
			for {
				i := next.Add(1)
				if i > n {
					return
				}
				t0 := time.Now()
				if due != nil {
					t0 = due(start, i)
					time.Sleep(time.Until(t0))
				}
				if err := op(ctx, i); err != nil {
					b.Error(err)
					return
				}
				lat[w] = append(lat[w], time.Since(t0))
			}
		})
	}
	wg.Wait()
	el := time.Since(start)
	all := slices.Concat(lat...)
	slices.Sort(all)
	return el, all
}

// BenchmarkClaimCompletePaired compares batched and one-at-a-time
// claim+complete at 16 callers in rounds that alternate between the two
// (which goes first alternates too), each store in a schema of its own, and
// reports the median of the per-round rates and ratios: a machine whose
// speed drifts within a run moves both sides of a round alike. b.N
// operations per mode, split over 9 rounds.
func BenchmarkClaimCompletePaired(b *testing.B) {
	const rounds, callers = 9, 16
	batched, brun := benchStore(b, false)
	single, srun := benchStore(b, true)
	per := max(1, int64(b.N)/rounds)
	var rb, rs, ratios []float64
	b.ResetTimer()
	for r := range int64(rounds) {
		rate := func(s *idempotency.Store, run string) float64 {
			el, _ := runOps(b, callers, per, nil, claimCompleteOp(s, run, r*per))
			return float64(per) / el.Seconds()
		}
		var x, y float64
		if r%2 == 0 {
			x, y = rate(batched, brun), rate(single, srun)
		} else {
			y, x = rate(single, srun), rate(batched, brun)
		}
		rb, rs, ratios = append(rb, x), append(rs, y), append(ratios, x/y)
	}
	b.StopTimer()
	median := func(v []float64) float64 { slices.Sort(v); return v[len(v)/2] }
	b.ReportMetric(median(rb), "batched-ops/s")
	b.ReportMetric(median(rs), "unbatched-ops/s")
	b.ReportMetric(median(ratios), "ratio")
	b.ReportMetric(float64(batched.BatchStats().Flushes)/float64(per*rounds), "commits/op")
}

// BenchmarkRunTxGroup measures same-database tasks (claim, an effect of one
// insert, completion, all in one transaction) of distinct operations run
// through transaction groups of up to 16 (BatchConfig.GroupTx), at 64
// concurrent callers on a pool of 16 connections, and reports operations
// per second and the p99 latency.
func BenchmarkRunTxGroup(b *testing.B) {
	pool, schema, s := ownPoolStore(b, 16, idempotency.BatchConfig{GroupTx: 16})
	ctx := context.Background()
	tbl := schema + ".effects"
	if _, err := pool.Exec(ctx, `CREATE TABLE `+tbl+` (key text NOT NULL, amount int NOT NULL)`); err != nil {
		b.Fatal(err)
	}
	run := fmt.Sprint(time.Now().UnixNano())
	drive(b, 64, nil, func(ctx context.Context, i int64) error {
		key := run + "-" + fmt.Sprint(i)
		p := idempotency.ClaimParams{Task: "bench", Key: key, Fingerprint: []byte("0123456789abcdef0123456789abcdef"),
			Owner: "bench", TaskID: fmt.Sprint(i)}
		c, err := s.RunTx(ctx, p, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			_, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ($1, 1)`, key)
			return []byte(`{"ok":true}`), err
		})
		if err != nil || c.Outcome != idempotency.OutcomeFirst {
			return fmt.Errorf("run tx %d: %v %v", i, c.Outcome, err)
		}
		return nil
	})
	var n int64
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+tbl).Scan(&n); err != nil || n != int64(b.N) {
		b.Fatalf("%d effects (err %v), want %d", n, err, b.N)
	}
}

// BenchmarkFlushCost times, on one connection, flushes of the size 16
// callers make (seven claims and seven completions: 0.14 commits per
// operation), one after another, against the same round trip carrying
// less: the seven claims alone, the seven completions alone, two bare
// seven-row inserts in one transaction (one index, no conflict handling, no
// events: a floor for any statements that write the flush's 14 rows) and
// SELECT 1. The five alternate within each iteration. Between them, in
// three rounds, it measures the one-at-a-time rate at 16 callers. It
// reports each round trip's mean in µs, and the most operations per second
// 16 callers could reach if flushes of seven operations followed each other
// with no gap, over that rate: for the flush as it is and for bare inserts.
func BenchmarkFlushCost(b *testing.B) {
	const rows, rounds, callers = 7, 3, 16
	pool, schema, s := ownPoolStore(b, 1, idempotency.BatchConfig{})
	single, srun := benchStore(b, true)
	ctx := context.Background()
	bare := pgx.Identifier{schema, "bare"}.Sanitize()
	if _, err := pool.Exec(ctx, `CREATE TABLE `+bare+` (task text NOT NULL, key text NOT NULL, PRIMARY KEY (task, key))`); err != nil {
		b.Fatal(err)
	}
	insert := `INSERT INTO ` + bare + ` SELECT * FROM unnest($1::text[], $2::text[]) ON CONFLICT DO NOTHING RETURNING task, key`
	run, seq := fmt.Sprint(time.Now().UnixNano()), 0
	claims := func() []idempotency.ClaimParams {
		ps := make([]idempotency.ClaimParams, rows)
		for i := range ps {
			seq++
			ps[i] = idempotency.ClaimParams{
				Task: "bench", Key: run + "-" + fmt.Sprint(seq), Token: idempotency.NewToken(),
				Fingerprint: []byte("0123456789abcdef0123456789abcdef"), Owner: "bench", TaskID: fmt.Sprint(seq), Lease: time.Minute,
			}
		}
		return ps
	}
	refs := func(ps []idempotency.ClaimParams) []idempotency.Ref {
		rs := make([]idempotency.Ref, len(ps))
		for i, p := range ps {
			rs[i] = p.Ref(p.Token)
		}
		return rs
	}
	flush := func(ps []idempotency.ClaimParams, rs []idempotency.Ref) func() error {
		return func() error {
			n, err := idempotency.WriteFlush(s, ps, rs)
			if err == nil && n != len(ps)+len(rs) {
				err = fmt.Errorf("flush answered %d of %d claims and completions", n, len(ps)+len(rs))
			}
			return err
		}
	}
	send := func(batch *pgx.Batch) error { return pool.SendBatch(ctx, batch).Close() }
	bareInserts := func() error {
		batch := &pgx.Batch{}
		for range 2 {
			tasks, keys := make([]string, rows), make([]string, rows)
			for i := range rows {
				seq++
				tasks[i], keys[i] = "bench", run+"-"+fmt.Sprint(seq)
			}
			batch.Queue(insert, tasks, keys)
		}
		return send(batch)
	}
	selectOne := func() error {
		batch := &pgx.Batch{}
		batch.Queue(`SELECT 1`)
		return send(batch)
	}
	names := []string{"claims-us", "completions-us", "flush-us", "bare-us", "select1-us"}
	var sum [5]time.Duration
	timed := func(i int, f func() error) {
		t0 := time.Now()
		if err := f(); err != nil {
			b.Fatal(err)
		}
		sum[i] += time.Since(t0)
	}
	prev := claims()
	if err := flush(prev, nil)(); err != nil {
		b.Fatal(err)
	}
	per := max(1, b.N/rounds)
	var singles []float64
	b.ResetTimer()
	for r := range rounds {
		for range per {
			a, c := claims(), claims()
			timed(0, flush(a, nil))
			timed(1, flush(nil, refs(a)))
			timed(2, flush(c, refs(prev)))
			timed(3, bareInserts)
			timed(4, selectOne)
			prev = c
		}
		n := int64(per * rows)
		el, _ := runOps(b, callers, n, nil, claimCompleteOp(single, srun, int64(r)*n))
		singles = append(singles, float64(n)/el.Seconds())
	}
	b.StopTimer()
	mean := func(i int) float64 { return float64(sum[i].Microseconds()) / float64(per*rounds) }
	for i, name := range names {
		b.ReportMetric(mean(i), name)
	}
	slices.Sort(singles)
	unbatched := singles[len(singles)/2]
	b.ReportMetric(unbatched, "unbatched-ops/s")
	b.ReportMetric(rows*1e6/mean(2)/unbatched, "flush-ceiling-x")
	b.ReportMetric(rows*1e6/mean(3)/unbatched, "bare-ceiling-x")
}
