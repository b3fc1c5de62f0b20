package main

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceler/onceler/amqp"
)

// latStats is what a latency run measured.
type latStats struct {
	n        int
	p50, p99 time.Duration
	p99Cold  time.Duration // p99 with the warm-up's messages counted too
	busy     float64       // the machine's CPU busy while publishing, 0 to 1
	cpuUS    float64       // the consumer's CPU per message
	pgCPUUS  float64       // its PostgreSQL backends' CPU per message

	p50Last  time.Duration // p50 of the messages sent in the run's last second
	achieved float64       // the publish rate reached, messages a second

	setAside  int  // earlier runs the broker's epmd check overlapped
	disturbed bool // this run too: every attempt was overlapped
}

// latencyAttempts is how many times a latency run is made when the broker's
// epmd check (brokerSpawnMark) overlaps it; the check runs once a minute and
// a run lasts seconds, so a second attempt is clear of it.
const latencyAttempts = 3

// latencyClear runs latency, and runs it again when the broker started the
// Erlang VM of its epmd check meanwhile: that burst takes the machine from
// every process for half a second, whatever the consumer (brokerSpawnMark).
// The runs set aside are counted in out, and the report says so.
func (b *bench) latencyClear(ctx context.Context, sc scenario, run latRun, out *latStats) error {
	for attempt := 1; ; attempt++ {
		overlapped, err := b.latencyWatched(ctx, sc, run, out)
		if err != nil || !overlapped || attempt == latencyAttempts {
			out.setAside, out.disturbed = attempt-1, overlapped
			return err
		}
		fmt.Fprintf(os.Stderr, "(%s) the broker started the Erlang VM of its epmd check during the latency run (p99 %v): measuring again\n", sc.ID, out.p99)
		*out = latStats{}
	}
}

// latencyWatched runs latency while watching for the broker's epmd check.
func (b *bench) latencyWatched(ctx context.Context, sc scenario, run latRun, out *latStats) (overlapped bool, err error) {
	w := watchSpawns(brokerSpawnMark)
	defer func() { overlapped = w.Stop() > 0 }()
	return false, b.latency(ctx, sc, run, out)
}

// latRun is one latency run: its publish rate, and how many seconds of it
// are warm-up and how many are measured. A probe (of the sustained rate) is
// neither profiled nor dumped.
type latRun struct {
	rate, warmup, secs float64
	probe              bool
}

// latency runs the consumer of scenario sc on an empty queue, publishes at
// run.rate for run.warmup + run.secs seconds, and measures each message from the
// moment it was handed to the publisher to its end: the result's arrival on
// reply_to when results are published, else the moment the worker reported
// the task succeeded (task-succeeded, emitted once the record's completion
// or the same-database transaction committed, just before the ack); for the
// raw consumer (sc.Kind "raw"), the moment the delivery arrived, acked at
// once.
func (b *bench) latency(ctx context.Context, sc scenario, run latRun, out *latStats) error {
	rate := run.rate
	warm := int(rate * run.warmup)
	n := warm + max(200, int(rate*run.secs))
	queue, schema := b.names(sc, "-lat")
	reply := ""
	if sc.Replies {
		reply = queue + ".reply"
	}
	defer func() {
		b.broker.deleteQueues(queue, queue+".quarantine", reply)
		_ = dropSchema(context.WithoutCancel(ctx), b.o.dbURL, schema)
	}()
	if err := setupSchema(ctx, b.o.dbURL, schema); err != nil {
		return err
	}
	if reply != "" {
		if err := b.broker.declareReply(reply); err != nil {
			return err
		}
	}
	if credits(sc.Task) && sc.Kind != "raw" {
		if err := setupLedger(ctx, b.o.dbURL); err != nil {
			return err
		}
	}
	spec := msgSpec{Task: sc.Task, N: n, RunID: b.runID + sc.ID + "l", ReplyTo: reply, Ignore: reply == "", Accounts: sc.Accounts}
	msgs, _, err := spec.build()
	if err != nil {
		return err
	}
	index := make(map[string]int, n) // task id -> message
	for i, m := range msgs {
		index[m.CorrelationID] = i
	}

	// Results arrive on the reply queue; read them as they come.
	var arrived []time.Time
	var replies sync.WaitGroup
	replyCtx, stopReplies := context.WithTimeout(ctx, b.o.timeout)
	defer stopReplies()
	if reply != "" {
		arrived = make([]time.Time, n)
		ch, err := b.broker.conn.Channel()
		if err != nil {
			return fmt.Errorf("reply channel: %w", err)
		}
		in, err := ch.ConsumeWithContext(replyCtx, reply, "bench-replies", true, false, false, false, nil)
		if err != nil {
			_ = ch.Close()
			return fmt.Errorf("consume replies: %w", err)
		}
		// amqp091 blocks closing a channel whose deliveries are not drained:
		// cancel the consumer, drain, then close.
		defer func() {
			stopReplies()
			replies.Wait()
			for range in {
			}
			_ = ch.Close()
		}()
		replies.Go(func() { readReplies(replyCtx, in, index, arrived, n) })
	}

	doneFile := ""
	if reply == "" {
		f, err := os.CreateTemp("", "onceler-bench-done")
		if err != nil {
			return err
		}
		doneFile = f.Name()
		_ = f.Close()
		defer func() { _ = os.Remove(doneFile) }()
	}
	kind := "worker"
	if sc.Kind == "raw" {
		kind = "raw"
		if err := b.pub.Declare(ctx, amqp.CeleryQueue(queue)); err != nil {
			return err
		}
	}
	job := b.consumerJob(kind, queue, schema, n)
	job.DoneFile = doneFile
	job.Stages = b.o.latencyDump != "" && kind == "worker" && !run.probe
	if sc.ID+"-latency" == b.o.profiled && !run.probe {
		job.CPUProfile, job.MemProfile = b.o.cpuProfile, b.o.memProfile
	}
	ready := make(chan struct{})
	type outcome struct {
		res childResult
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		res, err := spawn(ctx, job, ready)
		done <- outcome{res, err}
	}()
	select {
	case <-ready:
	case o := <-done:
		return fmt.Errorf("worker ended before consuming: %v", o.err)
	}
	// The bench's own garbage collection (its heap holds every message of
	// the run) would take the cores from the worker in bursts of tens of
	// milliseconds: it waits until the run is over.
	runtime.GC()
	defer debug.SetGCPercent(debug.SetGCPercent(-1))
	cpu0, cpuErr := machineCPU()
	sent, err := publishSteady(ctx, b.prod, queue, msgs, rate)
	if err != nil {
		return err
	}
	if cpu1, err := machineCPU(); cpuErr == nil && err == nil {
		out.busy = cpu1.busySince(cpu0)
	}
	o := <-done
	if o.err != nil {
		return o.err
	}
	out.cpuUS = float64(o.res.CPU.Microseconds()) / float64(n)
	out.pgCPUUS = float64(o.res.PGCPU.Microseconds()) / float64(n)
	if reply != "" {
		replies.Wait()
	}
	stopReplies()

	ends := arrived
	var stages []taskTimes // for the dump: when each task's events were emitted
	if reply == "" {
		done, err := readDone(doneFile)
		if err != nil {
			return fmt.Errorf("read commit times: %w", err)
		}
		ends = make([]time.Time, n)
		stages = make([]taskTimes, n)
		for i, m := range msgs {
			stages[i] = done[m.CorrelationID]
			ends[i] = stages[i].done
		}
	}
	all := make([]time.Duration, n) // in sending order
	for i := range ends {
		if ends[i].IsZero() {
			return fmt.Errorf("message %d has no end time", i)
		}
		all[i] = max(0, ends[i].Sub(sent[i]))
	}
	if b.o.latencyDump != "" && !run.probe {
		if err := dumpLatencies(b.o.latencyDump+"."+strings.ReplaceAll(sc.ID, "'", "2")+".csv", sent, all, stages); err != nil {
			return err
		}
	}
	if n > 1 {
		out.achieved = float64(n-1) / sent[n-1].Sub(sent[0]).Seconds()
	}
	last := slices.Clone(all[max(warm, n-int(rate)):])
	sortDurations(last)
	out.p50Last = percentile(last, 0.50)
	lat := slices.Clone(all[warm:])
	sortDurations(lat)
	out.n, out.p50, out.p99 = len(lat), percentile(lat, 0.50), percentile(lat, 0.99)
	if warm > 0 {
		sortDurations(all)
		out.p99Cold = percentile(all, 0.99)
	}
	return nil
}

// readReplies records when each task's result arrived, until all n did.
func readReplies(ctx context.Context, in <-chan amqp091.Delivery, index map[string]int, arrived []time.Time, n int) {
	got := 0
	for got < n {
		select {
		case <-ctx.Done():
			return
		case d, ok := <-in:
			if !ok {
				return
			}
			now := time.Now()
			if i, ok := index[d.CorrelationId]; ok && arrived[i].IsZero() {
				arrived[i] = now
				got++
			} else {
				fmt.Fprintf(os.Stderr, "unexpected reply %q\n", d.CorrelationId)
			}
		}
	}
}

// dumpLatencies writes one line per message: when it was sent (ms since the
// first) and its latency (ms), for finding when a tail happened; with stages,
// also when its task-received and task-started events were emitted (ms after
// it was sent; empty when not seen), for finding where.
func dumpLatencies(path string, sent []time.Time, lat []time.Duration, stages []taskTimes) error {
	var sb strings.Builder
	sb.WriteString("sent_ms,latency_ms,received_ms,started_ms\n")
	msAfter := func(t, from time.Time) string {
		if t.IsZero() {
			return ""
		}
		return fmt.Sprintf("%.3f", float64(t.Sub(from).Microseconds())/1000)
	}
	for i := range lat {
		var received, started string
		if stages != nil {
			received, started = msAfter(stages[i].received, sent[i]), msAfter(stages[i].started, sent[i])
		}
		fmt.Fprintf(&sb, "%.3f,%.3f,%s,%s\n", float64(sent[i].Sub(sent[0]).Microseconds())/1000, float64(lat[i].Microseconds())/1000, received, started)
	}
	return os.WriteFile(path, []byte(sb.String()), 0o644)
}

// cpuTimes is the machine's CPU time from /proc/stat, in clock ticks: busy
// (all but idle and iowait) and in all.
type cpuTimes struct{ busy, total uint64 }

// machineCPU reads the machine's CPU times (Linux).
func machineCPU() (cpuTimes, error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return cpuTimes{}, err
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 5 || f[0] != "cpu" {
		return cpuTimes{}, fmt.Errorf("/proc/stat: unexpected first line %q", line)
	}
	var t cpuTimes
	for i, v := range f[1:] {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return cpuTimes{}, fmt.Errorf("/proc/stat: %w", err)
		}
		t.total += n
		if i != 3 && i != 4 { // idle, iowait
			t.busy += n
		}
	}
	return t, nil
}

// busySince is the share of the machine's CPU time busy since t0.
func (t cpuTimes) busySince(t0 cpuTimes) float64 {
	if t.total <= t0.total {
		return 0
	}
	return float64(t.busy-t0.busy) / float64(t.total-t0.total)
}
