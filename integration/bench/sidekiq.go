package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceler/onceler/sidekiq"
	"github.com/onceler/onceler/tasks"
)

// The Sidekiq scenarios: N jobs of bench.outside pre-pushed as Sidekiq 6
// pushes them (Sidekiq::Client.push: a JSON job hash LPUSHed to
// queue:<name>, the name added to "queues") into a queue of the -redis
// database, drained by (s-raw) a raw reliable-fetch loop (LMOVE to a
// working list, then LREM: what any Sidekiq consumer that keeps its jobs
// across a crash does at least) or (s) the onceler worker with
// tasks.Config.Sidekiq and the record.

// sidekiqJobs returns n Sidekiq job payloads of taskOutside on queue and
// their operation ids.
func sidekiqJobs(queue, runID string, n int) ([]any, []string) {
	now := float64(time.Now().UnixMicro()) / 1e6
	jobs := make([]any, n)
	ops := make([]string, n)
	var jid [12]byte
	for i := range jobs {
		ops[i] = runID + "-" + strconv.Itoa(i)
		_, _ = rand.Read(jid[:])
		b, _ := json.Marshal(map[string]any{"class": taskOutside, "args": []any{ops[i]}, "queue": queue,
			"jid": hex.EncodeToString(jid[:]), "retry": true, "created_at": now, "enqueued_at": now})
		jobs[i] = string(b)
	}
	return jobs, ops
}

func redisClient(url string) (*redis.Client, error) {
	opt, err := redis.ParseURL(url)
	if err != nil {
		return nil, fmt.Errorf("-redis %s: %w", tasks.RedactResultBackend(url), err)
	}
	opt.DisableIdentity = true
	return redis.NewClient(opt), nil
}

// drainSidekiq is drain for the Sidekiq scenarios.
func (b *bench) drainSidekiq(ctx context.Context, sc scenario) row {
	r := row{sc: sc, n: b.o.n}
	queue, schema := b.names(sc, "")
	identity := "onceler-bench-" + b.runID + "-" + sc.ID
	rdb, err := redisClient(b.o.redisURL)
	if err != nil {
		r.drainError = err
		return r
	}
	defer func() { _ = rdb.Close() }()
	defer func() {
		ctx := context.WithoutCancel(ctx)
		_ = rdb.Del(ctx, "queue:"+queue, sidekiq.WorkingKey(identity, queue), identity, identity+":work").Err()
		_ = rdb.SRem(ctx, "queues", queue).Err()
		_ = rdb.SRem(ctx, "processes", identity).Err()
		_ = rdb.HDel(ctx, "onceler:working", identity).Err()
		_ = rdb.HDel(ctx, "onceler:epoch", identity).Err()
		_ = dropSchema(ctx, b.o.dbURL, schema)
	}()
	r.drainError = func() error {
		if err := rdb.Del(ctx, "queue:"+queue).Err(); err != nil {
			return fmt.Errorf("redis: %w", err)
		}
		if err := setupSchema(ctx, b.o.dbURL, schema); err != nil {
			return err
		}
		jobs, ops := sidekiqJobs(queue, b.runID+sc.ID, r.n)
		t0 := time.Now()
		for len(jobs) > 0 {
			batch := jobs[:min(len(jobs), 1000)]
			jobs = jobs[len(batch):]
			if _, err := rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
				p.SAdd(ctx, "queues", queue)
				p.LPush(ctx, "queue:"+queue, batch...)
				return nil
			}); err != nil {
				return fmt.Errorf("push the jobs: %w", err)
			}
		}
		fmt.Fprintf(os.Stderr, "(%s) pre-pushed %d Sidekiq jobs in %v\n", sc.ID, r.n, time.Since(t0).Round(time.Millisecond))
		if d, err := rdb.LLen(ctx, "queue:"+queue).Result(); err != nil || d != int64(r.n) {
			return fmt.Errorf("queue holds %d jobs, want %d (%v)", d, r.n, err)
		}
		c0, err := b.commits.read(ctx)
		if err != nil {
			return err
		}
		job := b.consumerJob(sc.Kind, queue, schema, r.n)
		job.SidekiqURL, job.Identity = b.o.redisURL, identity
		if _, err := b.drainQueued(ctx, sc, &r, job, redisPID(b.o.redisURL), c0); err != nil {
			return err
		}
		// Every job gone from the queue and the working list, every
		// operation completed in the record.
		for _, k := range []string{"queue:" + queue, sidekiq.WorkingKey(identity, queue)} {
			if d, err := rdb.LLen(ctx, k).Result(); err != nil || d != 0 {
				return fmt.Errorf("after the run %s holds %d jobs (%v)", k, d, err)
			}
		}
		for _, set := range []string{"retry", "dead"} {
			if n, err := rdb.ZCard(ctx, set).Result(); err != nil || n != 0 {
				return fmt.Errorf("after the run the %s set holds %d jobs (%v)", set, n, err)
			}
		}
		if sc.Kind == "sidekiq-raw" {
			return nil
		}
		return verifyCompleted(ctx, b.o.dbURL, schema, len(ops))
	}()
	return r
}

// runSidekiqRaw is the ceiling of the Sidekiq scenarios: one loop moves
// each job with LMOVE from the queue to a working list (as the worker's
// reliable fetch, one job at a time), job.Prefetch jobs at most out, and
// job.Concurrency goroutines remove each from the working list with LREM
// (as the worker settles a job), nothing else.
func runSidekiqRaw(ctx context.Context, job childJob) (childResult, error) {
	var res childResult
	rdb, err := redisClient(job.SidekiqURL)
	if err != nil {
		return res, err
	}
	defer func() { _ = rdb.Close() }()
	if err := rdb.Ping(ctx).Err(); err != nil {
		return res, fmt.Errorf("sidekiq-raw: %w", err)
	}
	queue, working := "queue:"+job.Queue, sidekiq.WorkingKey(job.Identity, job.Queue)
	fmt.Println("READY")
	stop := startProfile(job)
	defer stop()
	set := startRawSettlers(job, func(v string) error {
		if err := rdb.LRem(ctx, working, 1, v).Err(); err != nil {
			return fmt.Errorf("sidekiq-raw: lrem: %w", err)
		}
		return nil
	})
	var fetchErr error
	for fetched := 0; fetched < job.Expect; {
		if err := set.err(); err != nil {
			fetchErr = err
			break
		}
		select {
		case set.window <- struct{}{}:
		case <-ctx.Done():
			fetchErr = fmt.Errorf("sidekiq-raw: %d of %d after the timeout", set.done.Load(), job.Expect)
		}
		if fetchErr != nil {
			break
		}
		v, err := rdb.LMove(ctx, queue, working, "RIGHT", "LEFT").Result()
		if errors.Is(err, redis.Nil) {
			<-set.window
			fetchErr = fmt.Errorf("sidekiq-raw: queue empty after %d of %d jobs", fetched, job.Expect)
			break
		}
		if err != nil {
			fetchErr = fmt.Errorf("sidekiq-raw: lmove: %w", err)
			break
		}
		fetched++
		set.work <- v
	}
	res = set.finish()
	if fetchErr == nil {
		fetchErr = set.err()
	}
	return res, fetchErr
}

// redisPID is the process id of the redis-server on this machine that
// listens on url's port, 0 when there is none.
func redisPID(url string) int {
	opt, err := redis.ParseURL(url)
	if err != nil {
		return 0
	}
	_, port, _ := strings.Cut(opt.Addr, ":")
	dirs, _ := os.ReadDir("/proc")
	for _, d := range dirs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		comm, err := os.ReadFile("/proc/" + d.Name() + "/comm")
		if err != nil || strings.TrimSpace(string(comm)) != "redis-server" {
			continue
		}
		// Its command line, rewritten by the server: "redis-server 127.0.0.1:6379".
		if cmd, err := os.ReadFile("/proc/" + d.Name() + "/cmdline"); err == nil && strings.Contains(string(cmd), ":"+port) {
			return pid
		}
	}
	return 0
}
