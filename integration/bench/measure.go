package main

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/internal/testkit"
)

// measured fills r with what the consumer child reported: its rate (the
// tasks after the first over the time from the first to the last), its
// peak RSS, and its and its PostgreSQL backends' CPU per task.
func (r *row) measured(res childResult) {
	r.rate = float64(res.Done-1) / res.Elapsed.Seconds()
	r.rssKiB = res.PeakRSSKiB
	r.cpuUS = float64(res.CPU.Microseconds()) / float64(r.n)
	r.pgCPUUS = float64(res.PGCPU.Microseconds()) / float64(r.n)
}

// commitsSince sets r.commits: the bench database's commits per task
// since c0, less the bench's own queries.
func (b *bench) commitsSince(ctx context.Context, r *row, c0 int64) error {
	c1, err := b.commits.read(ctx)
	if err != nil {
		return err
	}
	r.commits = float64(c1-c0-int64(r.polls)) / float64(r.n)
	return nil
}

// drainQueued runs job, the consumer child of scenario sc, on the tasks
// waiting in its queue, and measures it into r: the CPU per task of the
// broker (the process brokerPID, none when 0) and of this process while
// it drains, what the child reported and the commits since c0.
func (b *bench) drainQueued(ctx context.Context, sc scenario, r *row, job childJob, brokerPID int, c0 int64) (childResult, error) {
	if sc.ID == b.o.profiled {
		job.CPUProfile, job.MemProfile = b.o.cpuProfile, b.o.memProfile
	}
	self0 := testkit.CPUTime()
	bcpu0 := procCPU(brokerPID)
	res, err := spawn(ctx, job, nil)
	if brokerPID > 0 {
		r.brokerCPUUS = float64((procCPU(brokerPID) - bcpu0).Microseconds()) / float64(r.n)
	}
	r.benchCPUUS = float64((testkit.CPUTime() - self0).Microseconds()) / float64(r.n)
	if err != nil {
		return res, err
	}
	r.measured(res)
	return res, b.commitsSince(ctx, r, c0)
}

// verifyCompleted checks that schema's record holds n completed
// operations.
func verifyCompleted(ctx context.Context, dbURL, schema string, n int) error {
	return withPool(ctx, dbURL, func(pool *pgxpool.Pool) error {
		var got int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{schema}.Sanitize()+".records WHERE status = 'completed'").Scan(&got); err != nil {
			return fmt.Errorf("count completed records: %w", err)
		}
		if got != n {
			return fmt.Errorf("%d completed records, want %d", got, n)
		}
		return nil
	})
}

// rawSettlers are the goroutines of a raw scenario (s-raw, sqs-raw) that
// settle what its fetch loop took: job.Concurrency of them, with at most
// job.Prefetch taken and not settled (window); they count what they
// settled and when the first and the last were.
type rawSettlers struct {
	window chan struct{}
	work   chan string
	cpu0   time.Duration
	done   atomic.Int64
	first  atomic.Int64
	last   atomic.Int64
	failed atomic.Value // a failure
	wg     sync.WaitGroup
}

// failure is a settler's error (atomic.Value keeps one concrete type).
type failure struct{ err error }

// startRawSettlers starts the settlers of job; settle settles one (a
// failure is kept, and the fetch loop stops at it).
func startRawSettlers(job childJob, settle func(v string) error) *rawSettlers {
	s := &rawSettlers{cpu0: testkit.CPUTime(), window: make(chan struct{}, max(1, job.Prefetch)), work: make(chan string, max(1, job.Prefetch))}
	for range max(1, job.Concurrency) {
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			for v := range s.work {
				if err := settle(v); err != nil {
					s.failed.Store(failure{err})
				}
				now := time.Now().UnixNano()
				if s.done.Add(1) == 1 {
					s.first.Store(now)
				}
				s.last.Store(now)
				<-s.window
			}
		}()
	}
	return s
}

// err is the first failure kept, nil if none.
func (s *rawSettlers) err() error {
	f, _ := s.failed.Load().(failure)
	return f.err
}

// finish waits for the settlers once nothing more is given them; returns
// what they did.
func (s *rawSettlers) finish() childResult {
	close(s.work)
	s.wg.Wait()
	var res childResult
	res.CPU = testkit.CPUTime() - s.cpu0
	res.Done = int(s.done.Load())
	res.First, res.Last = time.Unix(0, s.first.Load()), time.Unix(0, s.last.Load())
	res.Elapsed = res.Last.Sub(res.First)
	return res
}
