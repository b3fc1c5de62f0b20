package main

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/internal/testkit"
	"github.com/onceler/onceler/tasks"
)

// scenario is one row of the table.
type scenario struct {
	ID, Title string
	Kind      string // raw, worker, python
	Task      string
	Replies   bool
	DupEvery  int
	Latency   bool // measure latency at half load
	Events    bool // remote control and task events on, a monitor reading them (-monitor)
	Round     int  // the pair's round, for (f) and its (b) twins
	N         int  // messages, when not -n
	Redis     bool // results to the Redis result backend (-redis)
	Accounts  int  // taskCredit: the accounts credited in turn
}

var scenarios = []scenario{
	{ID: "a", Title: "raw consume + ack (ceiling)", Kind: "raw", Task: taskOutside},
	{ID: "b", Title: "onceler, outside no-op, ignore_result", Kind: "worker", Task: taskOutside, Latency: true},
	{ID: "b'", Title: "onceler, same-database demo.ledger.credit over 1,000 accounts, ignore_result", Kind: "worker", Task: taskCredit, Accounts: 1000, Latency: true},
	{ID: "b'-tx", Title: "(b') with the credit's statement run by a RunTx function instead of returned by RunStmt", Kind: "worker", Task: taskCreditTx, Accounts: 1000},
	{ID: "b'-hot", Title: "onceler, demo.ledger.credit, every credit to one account (hot row)", Kind: "worker", Task: taskCredit, Accounts: 1},
	{ID: "c", Title: "onceler, outside no-op, results to reply_to", Kind: "worker", Task: taskOutside, Replies: true, Latency: true},
	{ID: "c-redis", Title: "(c) with results to Redis (--result-backend redis://)", Kind: "worker", Task: taskOutside, Redis: true},
	{ID: "d", Title: "onceler, outside no-op, 20% duplicates", Kind: "worker", Task: taskOutside, DupEvery: 5},
	{ID: "e", Title: "Python Celery 5.2.6 prefork, same claim + completion", Kind: "python", Task: taskOutside},
	{ID: "f", Title: "(b) with remote control and task events on, a monitor's queue bound to celeryev", Kind: "worker", Task: taskOutside, Events: true},
	{ID: "s-raw", Title: "raw LMOVE + LREM of Sidekiq jobs in Redis (the Sidekiq ceiling)", Kind: "sidekiq-raw", Task: taskOutside},
	{ID: "s", Title: "onceler --sidekiq, outside no-op (Sidekiq jobs from Redis)", Kind: "sidekiq", Task: taskOutside},
	{ID: "sqs-raw", Title: "raw batched receive + delete of Celery messages on the local SQS server (the SQS ceiling)", Kind: "sqs-raw", Task: taskOutside},
	{ID: "sqs", Title: "onceler --sqs, outside no-op (Celery messages over SQS, kombu's envelope)", Kind: "sqs", Task: taskOutside},
}

// pairedWith is the scenario (f) alternates with: (b), measured again next
// to each run of (f) so that the ratio compares runs minutes apart at most.
const pairedWith = "b"

// row is one measured scenario.
type row struct {
	sc          scenario
	n           int
	rate        float64  // tasks/s
	lat         latStats // the worker at half load
	floor       latStats // the raw consumer at the same load: the broker path's own latency
	latRate     float64
	sustained   float64  // the highest publish rate the consumer kept up with; 0: not measured
	halfDrain   latStats // the worker at half the drain rate
	rssKiB      int64
	commits     float64 // per task
	cpuUS       float64 // consumer process CPU µs per task
	pgCPUUS     float64 // the worker's PostgreSQL backends' CPU µs per task
	brokerCPUUS float64 // the local RabbitMQ node's CPU µs per task while draining
	benchCPUUS  float64 // this process's (the events monitor's, for (f)) CPU µs per task while draining
	note        string
	polls       int     // the bench's own queries on the bench database during the run
	pairRatio   float64 // (f): median over the rounds of (f) / (b) in the same round
	drainError  error
}

type bench struct {
	o       options
	runID   string
	pub     *amqp.Publisher // declarations
	prod    *producer
	broker  *broker
	commits *commitCounter
}

func newBench(ctx context.Context, o options) (*bench, error) {
	if err := ensureDatabase(ctx, o.dbURL); err != nil {
		return nil, err
	}
	cc, err := newCommitCounter(ctx, o.dbURL)
	if err != nil {
		return nil, err
	}
	br, err := dialBroker(o.amqpURL)
	if err != nil {
		cc.close(ctx)
		return nil, err
	}
	prod, err := newProducer(o.amqpURL)
	if err != nil {
		br.close()
		cc.close(ctx)
		return nil, err
	}
	return &bench{
		o:       o,
		prod:    prod,
		runID:   strconv.FormatInt(time.Now().Unix()%1000000, 36),
		pub:     amqp.NewPublisher(amqp.Config{URL: o.amqpURL, Name: "onceler-bench-producer"}),
		broker:  br,
		commits: cc,
	}, nil
}

func (b *bench) close() {
	_ = b.pub.Close()
	b.prod.close()
	b.broker.close()
	b.commits.close(context.Background())
}

func (b *bench) runAll(ctx context.Context, ids []string) ([]row, error) {
	want := map[string]bool{}
	for _, id := range ids {
		want[strings.TrimSpace(id)] = true
	}
	var rows []row
	var errs []error
	for _, sc := range scenarios {
		if !want[sc.ID] {
			continue
		}
		fmt.Fprintf(os.Stderr, "(%s) %s: draining...\n", sc.ID, sc.Title)
		var r row
		if sc.Events {
			r = b.paired(ctx, sc)
		} else {
			r = b.drain(ctx, sc)
		}
		if r.drainError != nil {
			errs = append(errs, fmt.Errorf("(%s): %w", sc.ID, r.drainError))
			fmt.Fprintf(os.Stderr, "(%s) failed: %v\n", sc.ID, r.drainError)
		} else {
			fmt.Fprintf(os.Stderr, "(%s) %d tasks, %.0f tasks/s, %.3f commits/task, peak RSS %d KiB, CPU %.0f µs/task, PG CPU %.0f µs/task\n",
				sc.ID, r.n, r.rate, r.commits, r.rssKiB, r.cpuUS, r.pgCPUUS)
		}
		rows = append(rows, r)
		if ctx.Err() != nil {
			return rows, ctx.Err()
		}
	}
	if b.o.latencySecs > 0 {
		for i := range rows {
			r := &rows[i]
			if !r.sc.Latency || r.drainError != nil || r.rate <= 0 {
				continue
			}
			if err := b.latencies(ctx, r); err != nil {
				errs = append(errs, err)
				fmt.Fprintf(os.Stderr, "%v\n", err)
			}
		}
	}
	return rows, errors.Join(errs...)
}

// latencies measures r's scenario at half load: half the sustained rate,
// the highest publish rate its consumer keeps up with (sustainedRate), or
// -latency-rate. Then the raw consumer at the same rate, and, for
// comparison, the worker at half the drain rate.
func (b *bench) latencies(ctx context.Context, r *row) error {
	r.latRate = b.o.latencyRate
	if r.latRate <= 0 {
		sustained, err := b.sustainedRate(ctx, r.sc, r.rate)
		if err != nil {
			return fmt.Errorf("(%s) sustained rate: %w", r.sc.ID, err)
		}
		r.sustained, r.latRate = sustained, sustained/2
	}
	run := latRun{rate: r.latRate, warmup: b.o.latencyWarmup, secs: b.o.latencySecs}
	fmt.Fprintf(os.Stderr, "(%s) latency at %.0f tasks/s for %g s after %g s of warm-up...\n", r.sc.ID, run.rate, run.secs, run.warmup)
	if err := b.latencyClear(ctx, r.sc, run, &r.lat); err != nil {
		return fmt.Errorf("(%s) latency: %w", r.sc.ID, err)
	}
	fmt.Fprintf(os.Stderr, "(%s) p50 %v p99 %v over %d tasks; CPU µs/task: worker %.0f, PostgreSQL %.0f\n",
		r.sc.ID, r.lat.p50, r.lat.p99, r.lat.n, r.lat.cpuUS, r.lat.pgCPUUS)
	// The same load through the broker alone: the raw consumer
	// acknowledging each message as it arrives, the latency the worker's
	// own cannot go below on this machine.
	floor := r.sc
	floor.ID, floor.Kind, floor.Replies = r.sc.ID+"-floor", "raw", false
	if err := b.latencyClear(ctx, floor, run, &r.floor); err != nil {
		return fmt.Errorf("(%s) latency of the raw consumer: %w", r.sc.ID, err)
	}
	fmt.Fprintf(os.Stderr, "(%s) raw consumer at the same load: p50 %v p99 %v\n", r.sc.ID, r.floor.p50, r.floor.p99)
	if r.sustained == 0 {
		return nil
	}
	half := run
	half.rate, half.probe = r.rate/2, true
	if err := b.latencyClear(ctx, r.sc, half, &r.halfDrain); err != nil {
		return fmt.Errorf("(%s) latency at half the drain rate: %w", r.sc.ID, err)
	}
	fmt.Fprintf(os.Stderr, "(%s) at half the drain rate, %.0f tasks/s: p50 %v p99 %v\n", r.sc.ID, half.rate, r.halfDrain.p50, r.halfDrain.p99)
	return nil
}

// keptUp is the most the messages of a probe's last second may wait (their
// p50) for the consumer to count as keeping up: past its capacity the
// backlog, and with it the latency, grows through the run (at 2% over it,
// by 80 ms in four seconds).
const keptUp = 50 * time.Millisecond

// sustainedRate finds, by bisection within a twentieth of the drain rate
// (a fifth with -quick), the highest rate of steady publishing that sc's
// consumer keeps up with: the highest probe that kept up. It is lower than
// the drain rate, which is measured with the queue filled beforehand: while
// messages are published at the same time the broker's publish path takes
// its share of the machine, about as much as its deliveries. A probe keeps
// up when the publisher reached at least 98% of its rate and the messages
// of its last second waited at most keptUp; the rate is an error when no
// probe, down to 0.3 of the drain rate, kept up.
func (b *bench) sustainedRate(ctx context.Context, sc scenario, drain float64) (float64, error) {
	probe := func(rate float64) (bool, error) {
		run := latRun{rate: rate, warmup: min(1, b.o.latencyWarmup), secs: min(3, b.o.latencySecs), probe: true}
		var st latStats
		if err := b.latencyClear(ctx, sc, run, &st); err != nil {
			return false, err
		}
		ok := st.p50Last <= keptUp && st.achieved >= 0.98*rate
		fmt.Fprintf(os.Stderr, "(%s) published at %.0f tasks/s (reached %.0f): p50 of the last second %v, kept up: %v\n",
			sc.ID, rate, st.achieved, st.p50Last, ok)
		return ok, nil
	}
	lo, hi := 0.3*drain, drain // lo: taken to be kept up with until a probe is; hi: not
	step := drain / 20
	if b.o.quick {
		step = drain / 5
	}
	passed := false
	for hi-lo > step {
		rate := (lo + hi) / 2
		ok, err := probe(rate)
		if err != nil {
			return 0, err
		}
		if ok {
			lo, passed = rate, true
		} else {
			hi = rate
		}
	}
	if !passed {
		ok, err := probe(lo)
		if err != nil {
			return 0, err
		}
		if !ok {
			return 0, fmt.Errorf("not kept up with even at %.0f tasks/s, 0.3 of the drain rate", lo)
		}
	}
	return lo, nil
}

// paired drains sc (f) and its twin without events (b) in turn, b.o.pairs
// times (the first of each pair alternating), and returns the row of the median (f) run with the
// median of the per-round ratios (f) / (b): the cost of events measured
// against runs next to it rather than against a (b) drained minutes before
// on a machine whose speed drifts.
func (b *bench) paired(ctx context.Context, sc scenario) row {
	var twin scenario
	for _, s := range scenarios {
		if s.ID == pairedWith {
			twin = s
		}
	}
	var fs []row
	var ratios, cpuRatios []float64
	var notes []string
	twin.N, sc.N = b.o.pairN, b.o.pairN
	for round := 1; round <= max(1, b.o.pairs); round++ {
		twin.Round, sc.Round = round, round
		// Alternate which goes first, so that a drift of the machine's
		// speed within a round does not favour one side.
		var rb, rf row
		if round%2 == 1 {
			rb, rf = b.drain(ctx, twin), b.drain(ctx, sc)
		} else {
			rf, rb = b.drain(ctx, sc), b.drain(ctx, twin)
		}
		if rb.drainError != nil {
			return row{sc: sc, n: b.o.n, drainError: fmt.Errorf("round %d, (%s) without events: %w", round, twin.ID, rb.drainError)}
		}
		if rf.drainError != nil {
			return rf
		}
		fs = append(fs, rf)
		ratios = append(ratios, rf.rate/rb.rate)
		cpuRatios = append(cpuRatios, (rf.cpuUS+rf.pgCPUUS+rf.brokerCPUUS)/(rb.cpuUS+rb.pgCPUUS+rb.brokerCPUUS))
		notes = append(notes, fmt.Sprintf("%.0f/%.0f", rf.rate, rb.rate))
		fmt.Fprintf(os.Stderr, "(%s) round %d: %.0f tasks/s with events, %.0f without: %.3f; CPU µs/task with/without: worker %.0f/%.0f, PostgreSQL %.0f/%.0f, broker %.0f/%.0f, bench and monitor %.0f/%.0f\n",
			sc.ID, round, rf.rate, rb.rate, rf.rate/rb.rate, rf.cpuUS, rb.cpuUS, rf.pgCPUUS, rb.pgCPUUS, rf.brokerCPUUS, rb.brokerCPUUS, rf.benchCPUUS, rb.benchCPUUS)
	}
	slices.SortFunc(fs, func(x, y row) int { return cmp.Compare(x.rate, y.rate) })
	r := fs[len(fs)/2]
	slices.Sort(ratios)
	slices.Sort(cpuRatios)
	r.pairRatio = ratios[len(ratios)/2]
	r.note = fmt.Sprintf("N = %d, monitor %s, median of %d rounds; tasks/s with/without events per round: %s; median ratio %.3f (quartiles %.3f–%.3f); "+
		"CPU per task of worker, PostgreSQL and broker together, with/without events: median %.3f",
		r.n, b.o.monitor, len(fs), strings.Join(notes, ", "), r.pairRatio, ratios[len(ratios)/4], ratios[len(ratios)*3/4], cpuRatios[len(cpuRatios)/2])
	return r
}

// names returns the queue and schema of a scenario run.
func (b *bench) names(sc scenario, suffix string) (queue, schema string) {
	if sc.Round > 0 {
		suffix = fmt.Sprintf("-r%d", sc.Round) + suffix
	}
	id := strings.ReplaceAll(sc.ID, "'", "2")
	return "onceler-bench-" + b.runID + "-" + id + suffix, "bench_" + b.runID + "_" + strings.ReplaceAll(id+suffix, "-", "_")
}

func (b *bench) drain(ctx context.Context, sc scenario) row {
	if strings.HasPrefix(sc.Kind, "sidekiq") {
		return b.drainSidekiq(ctx, sc)
	}
	if strings.HasPrefix(sc.Kind, "sqs") {
		return b.drainSQS(ctx, sc)
	}
	r := row{sc: sc, n: b.o.n}
	if sc.N > 0 {
		r.n = sc.N
	}
	if sc.Kind == "python" {
		r.n = b.o.pyN
		if r.n != b.o.n {
			r.note = fmt.Sprintf("N = %d", r.n)
		}
	}
	queue, schema := b.names(sc, "")
	reply := ""
	if sc.Replies {
		reply = queue + ".reply"
	}
	defer func() {
		b.broker.deleteQueues(queue, queue+".quarantine", reply)
		_ = dropSchema(context.WithoutCancel(ctx), b.o.dbURL, schema)
	}()
	err := func() error {
		if err := setupSchema(ctx, b.o.dbURL, schema); err != nil {
			return err
		}
		if credits(sc.Task) {
			if err := setupLedger(ctx, b.o.dbURL); err != nil {
				return err
			}
		}
		if err := b.pub.Declare(ctx, amqp.CeleryQueue(queue)); err != nil {
			return fmt.Errorf("declare %s: %w", queue, err)
		}
		if reply != "" {
			if err := b.broker.declareReply(reply); err != nil {
				return err
			}
		}
		spec := msgSpec{Task: sc.Task, N: r.n, RunID: b.runID + sc.ID, ReplyTo: reply, Ignore: reply == "" && !sc.Redis,
			DupEvery: sc.DupEvery, DupGap: 4 * b.o.rawPrefetch(), Accounts: sc.Accounts}
		msgs, ops, err := spec.build()
		if err != nil {
			return err
		}
		t0 := time.Now()
		if err := publishAll(ctx, b.prod, queue, msgs); err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "(%s) pre-filled %d messages in %v\n", sc.ID, len(msgs), time.Since(t0).Round(time.Millisecond))
		if d, err := b.broker.depth(queue); err != nil || d != len(msgs) {
			return fmt.Errorf("queue holds %d messages, want %d (%v)", d, len(msgs), err)
		}
		c0, err := b.commits.read(ctx)
		if err != nil {
			return err
		}
		// The broker's CPU is read when the consumer is done: after it, (f)'s
		// monitor reads the events and the run is verified, and neither is
		// the drain's.
		bpid := brokerPID()
		bcpu0 := procCPU(bpid)
		brokerDone := func() {
			if bpid > 0 {
				r.brokerCPUUS = float64((procCPU(bpid) - bcpu0).Microseconds()) / float64(r.n)
			}
		}
		switch sc.Kind {
		case "python":
			err := b.runPython(ctx, &r, queue, schema)
			brokerDone()
			if err != nil {
				return err
			}
		default:
			job := b.consumerJob(sc.Kind, queue, schema, r.n)
			job.Events = sc.Events
			if sc.Redis {
				job.ResultBackend = b.o.redisURL
			}
			if sc.ID == b.o.profiled && sc.Round <= 1 {
				job.CPUProfile, job.MemProfile = b.o.cpuProfile, b.o.memProfile
			}
			var mon *monitor
			self0 := testkit.CPUTime()
			defer func() { r.benchCPUUS = float64((testkit.CPUTime() - self0).Microseconds()) / float64(r.n) }()
			if sc.Events && b.o.monitor != monitorNone {
				mqueue, _ := b.names(sc, ".events")
				if mon, err = startMonitor(b.broker, mqueue, b.o.monitor == monitorLive); err != nil {
					return err
				}
				defer mon.close()
			}
			res, err := spawn(ctx, job, nil)
			brokerDone()
			if err != nil {
				return err
			}
			if mon != nil && b.o.monitor == monitorAfter {
				if err := mon.consume(); err != nil {
					return err
				}
			}
			if sent := res.Counts["events_sent"]; sc.Events && sent < float64(3*r.n) {
				return fmt.Errorf("the worker published %.0f events, want at least 3 per task (%d)", sent, 3*r.n)
			}
			if mon != nil {
				if err := mon.wait(r.n, 10*time.Second); err != nil {
					return err
				}
			}
			if c := res.Counts; c["tx_grouped"]+c["tx_alone"] > 0 {
				fmt.Fprintf(os.Stderr, "(%s) transaction groups: %.0f tasks in %.0f groups, %.0f alone\n", sc.ID, c["tx_grouped"], c["tx_groups"], c["tx_alone"])
			}
			r.measured(res)
		}
		if err := b.commitsSince(ctx, &r, c0); err != nil {
			return err
		}
		if err := b.verify(ctx, sc, spec, queue, schema, reply, ops); err != nil || !sc.Redis {
			return err
		}
		return verifyRedis(ctx, b.o.redisURL, msgs)
	}()
	r.drainError = err
	return r
}

// consumerJob is a consumer child of kind on queue and schema, expecting n
// tasks, with the bench's worker settings.
func (b *bench) consumerJob(kind, queue, schema string, n int) childJob {
	prefetch, concurrency := b.o.prefetch, b.o.concurrency
	switch kind {
	case "raw":
		prefetch = b.o.rawPrefetch()
	case "sidekiq-raw", "sqs-raw":
		prefetch = b.o.rawPrefetch()
		if concurrency <= 0 {
			concurrency = tasks.DefaultConcurrency()
		}
	}
	return childJob{Kind: kind, AMQPURL: b.o.amqpURL, DatabaseURL: b.o.dbURL, Queue: queue, Schema: schema,
		Expect: n, Prefetch: prefetch, Concurrency: concurrency, PoolConns: b.o.poolConns,
		Flushers: b.o.flushers, Linger: b.o.linger, GroupTx: b.o.groupTx,
		Timeout: b.o.timeout, Debug: b.o.debug, GOGC: b.o.workerGOGC, Procs: b.o.workerProcs}
}

// verify checks that the run did what it claims: the queue is empty, every
// operation is completed once, every effect happened once, every result
// arrived.
func (b *bench) verify(ctx context.Context, sc scenario, spec msgSpec, queue, schema, reply string, ops []string) error {
	if d, err := b.broker.depth(queue); err != nil || d != 0 {
		return fmt.Errorf("after the run the queue holds %d messages (%v)", d, err)
	}
	distinct := map[string]bool{}
	for _, op := range ops {
		distinct[op] = true
	}
	if reply != "" {
		if d, err := b.broker.depth(reply); err != nil || d != len(ops) {
			return fmt.Errorf("reply queue holds %d results, want %d (%v)", d, len(ops), err)
		}
	}
	if sc.Kind == "raw" {
		return nil
	}
	return withPool(ctx, b.o.dbURL, func(pool *pgxpool.Pool) error {
		s := pgx.Identifier{schema}.Sanitize()
		table, where := s+".records", "status = 'completed'"
		if sc.Kind == "python" {
			table = s + ".py_records"
		}
		var n int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+table+" WHERE "+where).Scan(&n); err != nil {
			return fmt.Errorf("count completed records: %w", err)
		}
		if n != len(distinct) {
			return fmt.Errorf("%d completed records, want %d", n, len(distinct))
		}
		if credits(sc.Task) {
			if err := pool.QueryRow(ctx, "SELECT count(*) FROM onceler_demo.ledger WHERE entry_id = ANY($1)", ops).Scan(&n); err != nil {
				return fmt.Errorf("count ledger entries: %w", err)
			}
			if n != len(distinct) {
				return fmt.Errorf("%d ledger entries, want %d", n, len(distinct))
			}
			accounts := make([]string, min(len(ops), max(1, sc.Accounts)))
			for i := range accounts {
				accounts[i] = spec.account(i)
			}
			var total int64
			if err := pool.QueryRow(ctx, "SELECT coalesce(sum(cents), 0)::bigint FROM onceler_demo.balances WHERE account = ANY($1)", accounts).Scan(&total); err != nil {
				return fmt.Errorf("sum balances: %w", err)
			}
			if want := int64(len(distinct)) * creditCents; total != want {
				return fmt.Errorf("balances sum to %d, want %d", total, want)
			}
		}
		if sc.DupEvery > 0 {
			var dups int
			if err := pool.QueryRow(ctx, "SELECT coalesce(sum(duplicate_count), 0) FROM "+table).Scan(&dups); err != nil {
				return fmt.Errorf("count duplicates: %w", err)
			}
			if dups != len(ops)-len(distinct) {
				return fmt.Errorf("%d duplicates recorded, want %d", dups, len(ops)-len(distinct))
			}
		}
		return nil
	})
}

// spawn runs job in a child process; ready (when not nil) is closed once it
// consumes.
func spawn(ctx context.Context, job childJob, ready chan<- struct{}) (childResult, error) {
	var res childResult
	exe, err := os.Executable()
	if err != nil {
		return res, fmt.Errorf("find own executable: %w", err)
	}
	spec, err := json.Marshal(job)
	if err != nil {
		return res, err
	}
	cmd := exec.CommandContext(ctx, exe)
	cmd.Env = append(os.Environ(), childEnv+"="+string(spec))
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return res, err
	}
	if err := cmd.Start(); err != nil {
		return res, fmt.Errorf("start child: %w", err)
	}
	got := false
	sc := bufio.NewScanner(out)
	sc.Buffer(make([]byte, 1<<16), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "READY":
			if ready != nil {
				close(ready)
				ready = nil
			}
		case strings.HasPrefix(line, "RESULT "):
			if err := json.Unmarshal([]byte(strings.TrimPrefix(line, "RESULT ")), &res); err == nil {
				got = true
			}
		}
	}
	_, _ = io.Copy(io.Discard, out)
	werr := cmd.Wait()
	if job.Debug {
		fmt.Fprintf(os.Stderr, "worker counters: %v\n", res.Counts)
	}
	switch {
	case !got:
		return res, fmt.Errorf("child gave no result: %v", werr)
	case res.Err != "":
		return res, errors.New(res.Err)
	case werr != nil:
		return res, fmt.Errorf("child: %w", werr)
	}
	return res, nil
}

// percentile returns the p-th percentile of sorted durations.
func percentile(d []time.Duration, p float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	i := int(float64(len(d)-1) * p)
	return d[i]
}

func sortDurations(d []time.Duration) { slices.Sort(d) }
