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

// TestFaultPostgresAsyncFailover shows what asynchronous replication costs,
// and TestFaultPostgresFailoverPartitioned that a synchronous standby does
// not charge it: partitionFailover with synchronous_standby_names empty.
//
// What it asserts, each operation by its batch and mode:
//   - first batch (replicated before the cut): record and effects intact;
//     the second call is answered from the record, no second effect;
//   - second batch, demo.ledger.credit (same database): every caller was
//     told SUCCESS and its message acked, yet after the failover there is
//     no record and no ledger entry (the effect went with the commit: lost
//     until the operation is called again); the second call finds no
//     record and runs it: one entry, as it must be;
//   - second batch, replay.notify (outside, its system in another
//     database): the outside call happened and stays; the record of it went
//     with the commit; the second call finds no record and calls again: two
//     effects, a duplicate the record exists to prevent;
//   - replay.slow (outside, policy retry) claimed before the cut and
//     completed after it: its caller answered, its message acked, its
//     outside call made; after the failover its record is a stale claim
//     (the claim reached the standby, the completion did not); the second
//     call takes the claim over by its policy and calls again: two effects;
//   - replay.slow claimed during the cut and still running at the crash: no
//     record after the failover; its lease renewal finds no claim and stops
//     it before its outside call; the delivery is claimed and run again on
//     the new primary: one effect.
func TestFaultPostgresAsyncFailover(t *testing.T) {
	faultTests(t)
	partitionFailover(t, false)
}

// TestFaultPostgresFailoverPartitioned is TestFaultPostgresAsyncFailover's
// scenario with a synchronous standby: while the standby is cut off, the
// primary's commits wait for it, so no operation of the second batch is
// answered or acknowledged; after the crash and the promotion the workers
// do them on the new primary: each effect once (outside ones too), every
// caller answered, and the second calls answered from the record.
func TestFaultPostgresFailoverPartitioned(t *testing.T) {
	faultTests(t)
	partitionFailover(t, true)
}

// partitionFailover: a primary and a standby (synchronous when sync), two
// workers whose database URL lists both, the outside system of
// replay.notify and replay.slow in another database (the shared test
// database). A first batch of 200 operations (demo.ledger.credit and
// replay.notify) completes and reaches the standby; four replay.slow (4 s)
// are claimed and their claims reach the standby. Then the network between
// primary and standby is cut (the standby's replication connection
// black-holed), two replay.slow of 15 s and a second batch of 200 are sent.
// The primary crashes (-m immediate) while the 15 s ones still run, and the
// standby is promoted. Then every operation is called again (new task ids).
func partitionFailover(t *testing.T, sync bool) {
	const slowOps, runningOps = 4, 2
	pg := startReplicated(t, sync)
	outsideURL := testkit.Postgres.URL(t)
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
	answered := func(ops []*operation) int {
		n := 0
		for _, o := range ops {
			for _, m := range o.msgs {
				if len(final(e.Replies(m.ID))) > 0 {
					n++
				}
			}
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
		return ops
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
	first := send("part-first")
	if !wl.wait(2 * time.Minute) {
		t.Fatalf("%d of %d calls answered", wl.answered(), len(wl.ids()))
	}
	pg.waitCaughtUp(t)
	// Outside operations in flight at the cut: replay.slow sleeps 4 s, then
	// calls the outside system. The cut comes once the standby has their
	// claims.
	seconds := map[*operation]int{}
	sendSlow := func(op string, secs int) *operation {
		o := &operation{task: "replay.slow", op: op}
		m := e.Message(o.task, testkit.NewID(), []any{o.op, secs}, nil)
		o.msgs = append(o.msgs, m)
		wl.by[o.op], wl.ops = o, append(wl.ops, o)
		seconds[o] = secs
		e.Publish(m)
		return o
	}
	var slow, running []*operation
	for i := range slowOps {
		slow = append(slow, sendSlow(wl.op("part-slow", i), 4))
	}
	claims := `SELECT count(*)::text FROM ` + pgx.Identifier{e.Schema, "records"}.Sanitize() + ` WHERE task = 'replay.slow'`
	if !testkit.Eventually(time.Minute, func() bool { return queryOne(t, pg.standby.url, claims) == strconv.Itoa(slowOps) }) {
		t.Fatalf("the standby has %s of %d replay.slow claims", queryOne(t, pg.standby.url, claims), slowOps)
	}
	pg.link.on.Store(true) // the partition: the standby receives nothing more
	// Outside operations claimed after the cut, still running (15 s) when
	// the primary crashes.
	for i := range runningOps {
		running = append(running, sendSlow(wl.op("part-running", i), 15))
	}
	second := send("part-second")
	if sync {
		// Commits wait for the standby: nothing of the second batch is
		// answered, nothing acknowledged.
		time.Sleep(6 * time.Second)
		if n := answered(second) + answered(slow) + answered(running); n != 0 {
			t.Errorf("%d calls answered while the synchronous standby was cut off, want 0", n)
		}
		if n, err := queueMessages(wl); err != nil || n != batch+slowOps+runningOps {
			t.Errorf("queue holds %d messages (err %v) while the synchronous standby was cut off, want every call since the cut (%d)", n, err, batch+slowOps+runningOps)
		}
	} else if !testkit.Eventually(2*time.Minute, func() bool { return answered(second)+answered(slow) == batch+slowOps }) {
		t.Fatalf("%d of %d calls answered", answered(second)+answered(slow), batch+slowOps)
	}
	if n := answered(running); n != 0 {
		t.Fatalf("%d of the %d operations meant to run across the crash already answered: the second batch took too long", n, runningOps)
	}
	primaryLSN := pg.queryPrimary(t, `SELECT pg_current_wal_lsn()::text`)
	standbyLSN := queryOne(t, pg.standby.url, `SELECT pg_last_wal_receive_lsn()::text`)
	credits2, notifies2 := byMode(second, demo.TaskCredit), byMode(second, "replay.notify")
	atCrash := []int{answered(credits2), answered(notifies2), answered(slow), answered(running)}
	crashed := time.Now()
	pg.primary.stop(t, "immediate")
	pg.link.close()
	pg.promote(t)
	e.Pool.Reset() // the harness's connections to the old primary are dead
	if sync && !wl.wait(2*time.Minute) {
		t.Fatalf("%d of %d calls answered after the failover", wl.answered(), len(wl.ids()))
	}

	// What the new primary has of each batch, before anyone calls again.
	type found struct{ records, completed, effects, answered int }
	look := func(ops []*operation) found {
		f := found{answered: answered(ops)}
		for _, o := range ops {
			f.effects += count(o)
			rec, err := e.Store.Get(ctx, o.task, o.op)
			switch {
			case err == nil:
				f.records++
				if rec.Status == idempotency.StatusCompleted {
					f.completed++
				}
			case !errors.Is(err, idempotency.ErrNotFound):
				t.Fatalf("record of %s: %v", o.op, err)
			}
		}
		return f
	}
	f1, fc, fn, fs := look(first), look(credits2), look(notifies2), look(slow)
	fr := look(running)
	if f1 != (found{batch, batch, batch, batch}) {
		t.Errorf("first batch after the failover: %+v, want %d records completed, %d effects, %d answered", f1, batch, batch, batch)
	}
	half := batch / 2
	if sync {
		// Nothing was lost: what the primary had not replicated it had not
		// answered either, and the workers did it again on the new primary.
		if fc != (found{half, half, half, half}) || fn != (found{half, half, half, half}) {
			t.Errorf("second batch after the failover: credit %+v, notify %+v; want each %d records completed, %d effects, %d answered", fc, fn, half, half, half)
		}
		if fs != (found{slowOps, slowOps, slowOps, slowOps}) {
			t.Errorf("slow operations after the failover: %+v, want %d records completed, %d effects, %d answered", fs, slowOps, slowOps, slowOps)
		}
		if fr != (found{runningOps, runningOps, runningOps, runningOps}) {
			t.Errorf("operations claimed during the cut, after the failover: %+v, want %d records completed, %d effects, %d answered", fr, runningOps, runningOps, runningOps)
		}
	} else {
		// The cut makes the loss certain: none of the second batch's
		// commits reached the standby.
		if fc != (found{0, 0, 0, half}) {
			t.Errorf("second batch credits after the failover: %+v, want no record, no ledger entry, every caller answered (SUCCESS)", fc)
		}
		if fn != (found{0, 0, half, half}) {
			t.Errorf("second batch notify after the failover: %+v, want no record, every outside call kept (%d), every caller answered", fn, half)
		}
		// Their claims reached the standby, their completions did not:
		// stale claims, their outside calls made, their callers answered.
		if fs != (found{slowOps, 0, slowOps, slowOps}) {
			t.Errorf("slow operations after the failover: %+v, want %d records left claimed, %d outside calls, every caller answered", fs, slowOps, slowOps)
		}
		if n, err := e.StaleClaims(ctx); err != nil || n != slowOps {
			t.Errorf("stale claims after the failover: %d (err %v), want the %d slow operations'", n, err, slowOps)
		}
		// Claimed during the cut and still running: their claims went with
		// the primary. (A claim made anew on the new primary may be there
		// already, once a lease renewal found none.)
		if fr.completed != 0 || fr.effects != 0 || fr.answered != 0 {
			t.Errorf("operations claimed during the cut, after the failover: %+v, want none completed, no effect yet, not answered", fr)
		}
		for _, o := range running {
			if rec, err := e.Store.Get(ctx, o.task, o.op); err == nil && !rec.ClaimedAt.After(crashed) {
				t.Errorf("%s: claimed at %s, before the crash (%s): the claim made during the cut survived", o.op, rec.ClaimedAt, crashed)
			}
		}
		// Their lease renewals on the new primary find no claim: the
		// tasks are stopped before their outside calls (lease lost), and
		// the deliveries claimed and run again: one outside call each.
		if !testkit.Eventually(time.Minute, func() bool { return answered(running) == runningOps }) {
			t.Fatalf("%d of the %d operations claimed during the cut answered after the failover", answered(running), runningOps)
		}
	}

	// Every operation called again.
	for _, o := range append(append([]*operation(nil), first...), second...) {
		wl.send(o.task, o.op)
	}
	for _, o := range append(append([]*operation(nil), slow...), running...) {
		m := e.Message(o.task, testkit.NewID(), []any{o.op, seconds[o]}, nil) // the same arguments
		o.msgs = append(o.msgs, m)
		e.Publish(m)
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
	so, st, sx := effectsAfter(slow)
	ro, rt, rx := effectsAfter(running)
	wantNotifyTwice := half
	if sync {
		wantNotifyTwice = 0
	}
	wantSlowTwice := slowOps
	if sync {
		wantSlowTwice = 0
	}
	if fo != batch || co != half || nt != wantNotifyTwice || no != half-wantNotifyTwice || st != wantSlowTwice || so != slowOps-wantSlowTwice ||
		ro != runningOps || ft+fx+ct+cx+nx+sx+rt+rx != 0 {
		t.Errorf("effects after the second calls: first batch %d once, %d twice, %d other; second credits %d once, %d twice, %d other; second notify %d once, %d twice, %d other; slow %d once, %d twice, %d other; running at the crash %d once, %d twice, %d other",
			fo, ft, fx, co, ct, cx, no, nt, nx, so, st, sx, ro, rt, rx)
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
	if n := answered(wl.ops); n != len(wl.ids()) {
		t.Errorf("%d of %d calls answered", n, len(wl.ids()))
	}
	if n, err := e.StaleClaims(ctx); err != nil || n != 0 {
		t.Errorf("stale claims: %d (err %v), want 0", n, err)
	}
	if n, err := e.QueueDepth(e.Queue); err != nil || n != 0 {
		t.Errorf("queue: %d messages left (err %v), want 0", n, err)
	}
	mode := "asynchronous"
	if sync {
		mode = "synchronous"
	}
	var b strings.Builder
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "batch\toperations\tanswered before crash\trecords after failover (completed)\teffects after failover\teffects after 2nd call\tduplicates\tlost until called again")
	row := func(name string, n, ans int, f found, ones, twos int) {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d (%d)\t%d\t%d\t%d\t%d\n", name, n, ans, f.records, f.completed, f.effects, ones+2*twos, twos, max(0, f.answered-f.effects))
	}
	row("first (replicated)", batch, batch, f1, fo, ft)
	row("second, same-database (credit)", half, atCrash[0], fc, co, ct)
	row("second, outside (notify, retry)", half, atCrash[1], fn, no, nt)
	row("in flight at the cut, outside (slow, retry)", slowOps, atCrash[2], fs, so, st)
	row("claimed during the cut, running at the crash (slow)", runningOps, atCrash[3], fr, ro, rt)
	_ = tw.Flush()
	t.Logf("%s standby cut off at WAL %s while the primary went on to %s; %d of the second batch's %d callers answered when the primary crashed; standby promoted; every operation then called again:\n%s",
		mode, standbyLSN, primaryLSN, atCrash[0]+atCrash[1], batch, b.String())
}

// TestFaultPostgresOutage stops PostgreSQL (a private server, pg_ctl stop
// -m fast) for two minutes under load: a backlog of 5,000 operations for
// two onceler workers. During the outage no message is acknowledged (the
// queue keeps every unanswered call, ready or unacknowledged), no caller is
// answered and /readyz answers 503; once the database is back, everything
// drains, each effect once, every caller answered.
func TestFaultPostgresOutage(t *testing.T) {
	faultTests(t)
	const ops, outage = 5000, 2 * time.Minute
	pg := startPostgres(t)
	e := replay.NewEnv(t, replay.Config{Binary: oncelerBin, Command: []string{"worker", "--migrate"}, DatabaseURL: pg.url})
	migrate(t, e)
	// The backlog first, then the workers.
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
		allNotReady := true
		for _, a := range addrs {
			if s := readyz(a); s != http.StatusServiceUnavailable {
				allNotReady = false
				t.Errorf("%s into the outage: /readyz of %s answered %d, want 503", time.Since(stopped).Round(time.Second), a, s)
			}
		}
		if allNotReady {
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
	t.Logf("PostgreSQL stopped for %s with %d of %d answered and %d messages in the queue; /readyz 503 at %d of %d samples (every 2 s); calls answered and messages queued unchanged throughout; drained in %s after it came back\n%s",
		outage, answered, ops, queued, notReady, samples, drained.Round(time.Second), closingTable(t, wl, byTask, nil))
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
