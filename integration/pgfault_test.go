package integration

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/internal/testkit"
)

// TestFaultPostgresFailover: a primary and a synchronous standby
// (synchronous_standby_names names it, synchronous_commit on); two workers
// whose database URL lists both servers with target_session_attrs=read-
// write. In the middle of a mixed stream the primary is stopped with -m
// immediate (a crash) and the standby promoted: the workers, never
// restarted, reconnect to the new primary; nothing is lost, same-database
// effects stay exactly once, every caller is answered. Then every operation
// is called again: each is answered from the record the new primary kept,
// with no second effect.
func TestFaultPostgresFailover(t *testing.T) {
	faultTests(t)
	pg := startReplicated(t, true)
	e := replay.NewEnv(t, replay.Config{Binary: ownBin, DatabaseURL: pg.url})
	migrate(t, e)
	e.StartWorker(replay.WorkerOptions{})
	e.StartWorker(replay.WorkerOptions{})
	wl := newWorkload(e)
	wl.outsideDown = true // the simulated outside systems live in the database that fails over
	mixed(wl, "failover", faultOps)
	testkit.Eventually(time.Minute, func() bool { return wl.answered() >= faultOps/5 })
	at := wl.answered()
	crashed := time.Now()
	pg.primary.stop(t, "immediate")
	pg.promote(t)
	promoted := time.Now()
	e.Pool.Reset() // the harness's connections to the old primary are dead
	var resumed time.Time
	if !testkit.Eventually(2*time.Minute, func() bool {
		n, err := completedSince(pg.standby.url, e.Schema, crashed)
		if err == nil && n > 0 {
			resumed = time.Now()
			return true
		}
		return false
	}) {
		t.Fatalf("no operation completed on the new primary within 2 minutes of the promotion")
	}
	if !wl.wait(3 * time.Minute) {
		t.Fatalf("%d of %d calls answered after the failover", wl.answered(), len(wl.ids()))
	}
	if n := e.Live(); n != 2 {
		t.Fatalf("%d of 2 workers running after the failover, want both (no restart)", n)
	}
	// Every operation called again (a second producer, a client's retry):
	// the record survived the failover, so each is answered from it.
	for _, o := range append([]*operation(nil), wl.ops...) {
		wl.send(o.task, o.op)
	}
	tl, byTask := finishByTask(t, wl, 2*time.Minute)
	if tl.ops != faultOps || at >= len(wl.ops) {
		t.Errorf("%d operations, %d answered when the primary stopped: want %d and the crash mid-stream", tl.ops, at, faultOps)
	}
	if tl.lost != 0 || tl.duplicates != 0 || tl.held != 0 || tl.answered != tl.calls {
		t.Errorf("%s: want none lost, none done twice, none held, every caller answered", tl)
	}
	t.Logf("primary stopped -m immediate with %d of %d answered; standby promoted %s after the crash; first completion on the new primary %s after the crash (%s after the promotion); every operation then called a second time\n%s",
		at, faultOps, promoted.Sub(crashed).Round(time.Millisecond), resumed.Sub(crashed).Round(time.Millisecond),
		resumed.Sub(promoted).Round(time.Millisecond), closingTable(t, wl, byTask, nil))
}

// TestFaultPostgresAsyncFailover shows what asynchronous replication costs:
// the same primary and standby with synchronous_standby_names empty. A
// first batch of operations completes and reaches the standby. Then the
// network between the two is cut (the standby's replication connection is
// black-holed) and a second batch completes: the primary commits without
// waiting, every caller is answered SUCCESS and every message acked. The
// primary crashes and the standby is promoted: the second batch's commits
// are gone. Then every operation is called again (new task ids).
//
// What it asserts, each operation by its batch and mode:
//   - first batch: record and effects intact; the second call is answered
//     from the record, no second effect;
//   - second batch, demo.ledger.credit (same database): after the failover
//     no record and no ledger entry, though its caller was told SUCCESS
//     (the effect went with the commit: lost until called again); the
//     second call finds no record and runs it: one entry, as it must be;
//   - second batch, replay.notify (outside, its system in another
//     database): the outside call happened and stays; the record of it went
//     with the commit; the second call finds no record and calls again: two
//     effects, a duplicate the record exists to prevent.
func TestFaultPostgresAsyncFailover(t *testing.T) {
	faultTests(t)
	pg := startReplicated(t, false)
	outsideURL := testkit.Postgres.URL(t) // the outside system: apart from the database that fails over
	e := replay.NewEnv(t, replay.Config{Binary: ownBin, DatabaseURL: pg.url,
		Env: []string{"ONCELER_OUTSIDE_DATABASE_URL=" + outsideURL}})
	migrate(t, e)
	e.StartWorker(replay.WorkerOptions{})
	e.StartWorker(replay.WorkerOptions{})
	ctx := context.Background()
	outside, err := pgxpool.New(ctx, outsideURL)
	if err != nil {
		t.Fatal(err)
	}
	defer outside.Close()
	count := func(o *operation) int {
		var n int
		var err error
		if o.task == demo.TaskCredit {
			n, err = demo.CountLedger(ctx, e.Pool, o.op)
		} else {
			n, err = countOwn(o.task)(ctx, outside, o.op)
		}
		if err != nil {
			t.Fatalf("effects of %s: %v", o.op, err)
		}
		return n
	}
	wl := newWorkload(e)
	const batch = 200
	send := func(prefix string) []*operation {
		var ops []*operation
		for i := range batch {
			task := demo.TaskCredit
			if i%2 == 1 {
				task = "replay.notify"
			}
			wl.send(task, wl.op(prefix, i))
			ops = append(ops, wl.ops[len(wl.ops)-1])
		}
		if !wl.wait(2 * time.Minute) {
			t.Fatalf("%d of %d calls answered", wl.answered(), len(wl.ids()))
		}
		return ops
	}
	first := send("async-first")
	pg.waitCaughtUp(t)
	pg.link.on.Store(true) // the partition: the standby receives nothing more
	second := send("async-second")
	primaryLSN := pg.queryPrimary(t, `SELECT pg_current_wal_lsn()::text`)
	standbyLSN := queryOne(t, pg.standby.url, `SELECT pg_last_wal_receive_lsn()::text`)
	pg.primary.stop(t, "immediate")
	pg.link.close()
	pg.promote(t)
	e.Pool.Reset() // the harness's connections to the old primary are dead

	// What the new primary has of each batch, before anyone calls again.
	type found struct{ records, claimed, effects, answered int }
	look := func(ops []*operation) found {
		var f found
		for _, o := range ops {
			f.effects += count(o)
			if len(final(e.Replies(o.msgs[0].ID))) > 0 {
				f.answered++
			}
			rec, err := e.Store.Get(ctx, o.task, o.op)
			switch {
			case err == nil:
				f.records++
				if rec.Status == idempotency.StatusClaimed {
					f.claimed++
				}
			case !errors.Is(err, idempotency.ErrNotFound):
				t.Fatalf("record of %s: %v", o.op, err)
			}
		}
		return f
	}
	byMode := func(ops []*operation, task string) []*operation {
		var out []*operation
		for _, o := range ops {
			if o.task == task {
				out = append(out, o)
			}
		}
		return out
	}
	credits2, notifies2 := byMode(second, demo.TaskCredit), byMode(second, "replay.notify")
	before := map[string]found{
		"first": look(first), "second credit": look(credits2), "second notify": look(notifies2),
	}
	if f := before["first"]; f.records != batch || f.claimed != 0 || f.effects != batch || f.answered != batch {
		t.Errorf("first batch after the failover: %+v, want %d records completed, %d effects, %d answered", f, batch, batch, batch)
	}
	// The partition makes the loss certain: none of the second batch's
	// commits reached the standby.
	if f := before["second credit"]; f.records != 0 || f.effects != 0 || f.answered != len(credits2) {
		t.Errorf("second batch credits after the failover: %+v, want no record, no ledger entry, every caller answered (SUCCESS)", f)
	}
	if f := before["second notify"]; f.records != 0 || f.effects != len(notifies2) || f.answered != len(notifies2) {
		t.Errorf("second batch notify after the failover: %+v, want no record, every outside call kept (%d), every caller answered", f, len(notifies2))
	}

	// Every operation called again.
	for _, o := range append(append([]*operation(nil), first...), second...) {
		wl.send(o.task, o.op)
	}
	if !wl.wait(2 * time.Minute) {
		t.Fatalf("%d of %d calls answered after the failover", wl.answered(), len(wl.ids()))
	}
	wl.stopWorkers()
	effectsAfter := func(ops []*operation) (ones, twos, other int) {
		for _, o := range ops {
			switch count(o) {
			case 1:
				ones++
			case 2:
				twos++
			default:
				other++
			}
		}
		return
	}
	fo, ft, fx := effectsAfter(first)
	co, ct, cx := effectsAfter(credits2)
	no, nt, nx := effectsAfter(notifies2)
	if fo != batch || co != len(credits2) || nt != len(notifies2) || ft+fx+ct+cx+no+nx != 0 {
		t.Errorf("effects after the second calls: first batch %d once, %d twice, %d other; second credits %d once, %d twice, %d other; second notify %d once, %d twice, %d other",
			fo, ft, fx, co, ct, cx, no, nt, nx)
	}
	for _, o := range wl.ops {
		for _, m := range o.msgs {
			for _, r := range final(e.Replies(m.ID)) {
				if r.Status != "SUCCESS" {
					t.Errorf("%s %s: caller %s got %s", o.task, o.op, m.ID, r)
				}
			}
		}
	}
	if n, err := e.StaleClaims(ctx); err != nil || n != 0 {
		t.Errorf("stale claims: %d (err %v), want 0", n, err)
	}
	if n, err := e.QueueDepth(e.Queue); err != nil || n != 0 {
		t.Errorf("queue: %d messages left (err %v), want 0", n, err)
	}
	var b strings.Builder
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "batch\toperations\tanswered SUCCESS\trecords after failover\teffects after failover\teffects after 2nd call\tduplicates\tlost until called again")
	fmt.Fprintf(tw, "first (replicated)\t%d\t%d\t%d\t%d\t%d\t%d\t%d\n", batch, before["first"].answered, before["first"].records, before["first"].effects, fo+2*ft, ft, 0)
	fmt.Fprintf(tw, "second, same-database (credit)\t%d\t%d\t%d\t%d\t%d\t%d\t%d\n", len(credits2), before["second credit"].answered, before["second credit"].records, before["second credit"].effects, co+2*ct, ct, len(credits2)-before["second credit"].effects)
	fmt.Fprintf(tw, "second, outside (notify, retry)\t%d\t%d\t%d\t%d\t%d\t%d\t%d\n", len(notifies2), before["second notify"].answered, before["second notify"].records, before["second notify"].effects, no+2*nt, nt, 0)
	_ = tw.Flush()
	t.Logf("asynchronous standby cut off at WAL %s while the primary went on to %s; primary crashed, standby promoted; every operation then called again:\n%s", standbyLSN, primaryLSN, b.String())
}

// TestFaultPostgresOutage stops PostgreSQL (a private server, pg_ctl stop
// -m fast) for two minutes under load: a backlog of 3,000 operations for
// two onceler workers. During the outage no message is acknowledged (the
// queue keeps every unanswered call, ready or unacknowledged), no caller is
// answered and /readyz answers 503; once the database is back, everything
// drains, each effect once, every caller answered.
func TestFaultPostgresOutage(t *testing.T) {
	faultTests(t)
	const ops, outage = 3000, 2 * time.Minute
	pg := startPostgres(t)
	e := replay.NewEnv(t, replay.Config{Binary: oncelerBin, Command: []string{"worker", "--migrate"}, DatabaseURL: pg.url})
	migrate(t, e)
	addrs := []string{freeAddr(t), freeAddr(t)}
	for _, a := range addrs {
		e.StartWorker(replay.WorkerOptions{Env: []string{"ONCELER_HTTP_ADDR=" + a}})
	}
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	readyz := func(addr string) int {
		resp, err := client.Get("http://" + addr + "/readyz")
		if err != nil {
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for _, a := range addrs {
		if !testkit.Eventually(30*time.Second, func() bool { return readyz(a) == http.StatusOK }) {
			t.Fatalf("/readyz of %s: %d before the outage, want 200", a, readyz(a))
		}
	}
	wl := newWorkload(e)
	wl.outsideDown = true // the simulated outside systems live in the stopped database
	kinds := []string{demo.TaskCredit, demo.TaskCharge, demo.TaskCredit, demo.TaskEmail}
	for i := range ops {
		task := kinds[i%len(kinds)]
		if i%100 == 7 {
			task = demo.TaskSleep
		}
		wl.send(task, wl.op("outage", i))
	}
	testkit.Eventually(time.Minute, func() bool { return wl.answered() >= ops/10 })
	pg.stop(t, "fast")
	stopped := time.Now()
	// Deliveries settled as the server stopped are settled within a few
	// seconds; from then on, nothing.
	time.Sleep(5 * time.Second)
	answered := wl.answered()
	queued, err := queueMessages(wl)
	if err != nil {
		t.Fatalf("queue: %v", err)
	}
	if queued != len(wl.ids())-answered {
		t.Errorf("queue holds %d messages with %d of %d calls answered, want every unanswered call (%d)", queued, answered, len(wl.ids()), len(wl.ids())-answered)
	}
	samples, notReady := 0, 0
	for time.Since(stopped) < outage {
		time.Sleep(2 * time.Second)
		samples++
		ready := true
		for _, a := range addrs {
			if s := readyz(a); s != http.StatusServiceUnavailable {
				ready = false
				t.Errorf("%s into the outage: /readyz of %s answered %d, want 503", time.Since(stopped).Round(time.Second), a, s)
			}
		}
		if ready {
			notReady++
		}
		if n := wl.answered(); n != answered {
			t.Errorf("%s into the outage: %d calls answered, %d at its start", time.Since(stopped).Round(time.Second), n, answered)
			answered = n
		}
		if n, err := queueMessages(wl); err != nil || n != queued {
			t.Errorf("%s into the outage: queue holds %d messages (err %v), %d at its start: a message was acknowledged", time.Since(stopped).Round(time.Second), n, err, queued)
			queued = n
		}
	}
	for _, w := range e.Workers() {
		if w.Exited() {
			t.Fatalf("worker %s exited during the outage (%s)", w.Name, w.State())
		}
	}
	pg.start(t)
	back := time.Now()
	if !wl.wait(5 * time.Minute) {
		t.Errorf("%d of %d calls answered 5 minutes after the database came back", wl.answered(), len(wl.ids()))
	}
	drained := time.Since(back)
	for _, a := range addrs {
		if s := readyz(a); s != http.StatusOK {
			t.Errorf("/readyz of %s: %d after the outage, want 200", a, s)
		}
	}
	tl, byTask := finishByTask(t, wl, time.Minute)
	if tl.ops != ops || tl.lost != 0 || tl.duplicates != 0 || tl.held != 0 || tl.answered != tl.calls {
		t.Errorf("%s: want %d operations, none lost, none done twice, none held, every caller answered", tl, ops)
	}
	t.Logf("PostgreSQL stopped for %s with %d of %d answered and %d messages in the queue; /readyz 503 at all %d samples; nothing answered or acknowledged; drained in %s after it came back\n%s",
		outage, answered, ops, queued, samples, drained.Round(time.Second), closingTable(t, wl, byTask, nil))
	if notReady != samples {
		t.Errorf("/readyz 503 at %d of %d samples", notReady, samples)
	}
}

// queueMessages is how many messages the workload's queue holds, ready and
// delivered but unacknowledged (rabbitmqctl where it can be run; else the
// ready ones only).
func queueMessages(wl *workload) (int, error) {
	if wl.ctl == nil {
		return wl.e.QueueDepth(wl.e.Queue)
	}
	out, err := wl.ctl("-q", "list_queues", "name", "messages")
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) == 2 && f[0] == wl.e.Queue {
			return strconv.Atoi(f[1])
		}
	}
	return 0, fmt.Errorf("queue %s not listed", wl.e.Queue)
}

// completedSince counts the records of schema completed in transactions
// that began after since, on the server at url.
func completedSince(url, schema string, since time.Time) (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, url)
	if err != nil {
		return 0, err
	}
	defer c.Close(ctx)
	var n int
	err = c.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{schema, "records"}.Sanitize()+
		` WHERE status = 'completed' AND completed_at > $1`, since).Scan(&n)
	return n, err
}

// finishByTask waits until every call not held is answered (timeout), stops
// the workers once the queue is empty, and checks every operation's
// guarantee; it returns the total and the tally of each task.
func finishByTask(t *testing.T, wl *workload, timeout time.Duration) (tally, map[string]*tally) {
	t.Helper()
	if !wl.wait(timeout) {
		t.Errorf("%d of %d calls answered", wl.answered(), len(wl.ids()))
	}
	wl.stopWorkers()
	byTask := wl.checkByTask(t)
	var tl tally
	for _, x := range byTask {
		tl.add(*x)
	}
	return tl, byTask
}

// closingTable is a fault test's closing table: for each task, the
// operations, the calls and how many were answered, the effects counted
// (count, or the workload's own counts when nil), the unexpected
// duplicates, the lost operations, and those held or failed by their
// outside system.
func closingTable(t *testing.T, wl *workload, byTask map[string]*tally, count func(task, op string) int) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if count == nil {
		count = func(task, op string) int {
			n, err := effects(ctx, wl.e.Pool, task, op)
			if err != nil {
				t.Fatalf("effects of %s: %v", op, err)
			}
			return n
		}
	}
	eff := map[string]int{}
	for _, o := range wl.ops {
		eff[o.task] += count(o.task, o.op)
	}
	names := make([]string, 0, len(byTask))
	for n := range byTask {
		names = append(names, n)
	}
	sort.Strings(names)
	var b strings.Builder
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "task\toperations\tcalls\tanswered\teffects\tduplicates\tlost\theld\tpolicy retry twice\toutside system failed\t")
	var total tally
	totalEff := 0
	row := func(name string, x tally, n int) {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t\n", name, x.ops, x.calls, x.answered, n, x.duplicates, x.lost, x.held, x.retried, x.outsideFailed)
	}
	for _, n := range names {
		row(n, *byTask[n], eff[n])
		total.add(*byTask[n])
		totalEff += eff[n]
	}
	row("total", total, totalEff)
	_ = tw.Flush()
	return b.String()
}
