package idempotency

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"
)

// The transaction group is a group commit for same-database tasks
// (BatchConfig.GroupTx): RunTx calls queue up and a flusher runs several of
// them in one transaction: one claim statement for the group, the tasks'
// functions one after another, one completion statement, one commit. When
// a function fails (or a claim is refused), that transaction is rolled back
// and the group runs again with each member inside its own savepoint, so a
// task whose function fails is rolled back alone, as if it had run in a
// transaction of its own; the others commit. A commit that fails fails
// every task of the group that was to commit.
//
// The functions run one after another on the flusher's connection, so a
// slow task delays the others of its group: groups suit short tasks.
//
// Adaptive groups (BatchConfig.GroupTx 0, the default) size themselves. A
// call that finds no other running runs at once in a transaction of its
// own: no added latency on a quiet store. Calls that come while others run
// queue up, and one group at a time takes as many of them as fit in
// AdaptiveGroupBudget of function time, estimated from the durations of
// recent functions: small groups under light load, large ones when the
// queue is deep. Only one group at a time runs its statements (its turn:
// the claim statement and the functions), so two
// groups never wait for each other's row locks in a cycle (deadlocks
// between groups), and the functions of a group, one after another on one
// connection, do not wait for each other's locks: the estimate (the median
// of the last functions of groups and of lone calls) is of their work. A
// group gives up its turn once its functions have run: the next group runs
// its statements while the last one completes its records and its commit
// is flushed to disk. The finishing group takes no more locks (its
// completion statement updates only the records its claims hold), so the
// next one at most waits for its commit. When functions are slow
// (the estimate and the last one over adaptiveSlow), calls run in
// transactions of their own, in parallel, as without groups. Until the
// estimate is fresh (two measurements, the last within estimateStale) a
// group holds one call: a probe, timed on the flusher's connection, so
// that slow functions are never queued one behind another before they are
// known to be slow, and every second of slow functions one probe measures
// again. When a function of a group (or a probe) runs for longer than
// adaptiveStuck, the calls queued behind it, and those that come until it
// returns, run alone too.

type txOp struct {
	ctx   context.Context
	p     ClaimParams
	fn    func(context.Context, pgx.Tx) ([]byte, error)
	state opState // guarded by txGroup.mu
	done  chan txResult
}

func (op *txOp) key() opKey         { return opKey{op.p.Task, op.p.Key} }
func (op *txOp) stateRef() *opState { return &op.state }

// newAttempt gives op a new token, for a run after its group's
// transaction rolled back: should a claim of the last attempt commit all
// the same (a function committed part of the transaction, its commit late
// to land), the run finds it another's, never its own.
func (op *txOp) newAttempt() { op.p.Token = NewToken() }

type txResult struct {
	c     Claim
	err   error
	alone bool // not run: run it in a transaction of its own (adaptive groups)
}

// AdaptiveGroupBudget is the function time an adaptive transaction group
// holds at most, estimated from recent functions' durations: the most a
// group's last member waits for the others' functions.
const AdaptiveGroupBudget = 20 * time.Millisecond

const (
	// adaptiveMax is the most members of an adaptive group.
	adaptiveMax = 256
	// adaptiveSlow is the function time from which adaptive groups leave
	// tasks to transactions of their own, in parallel: a commit is a small
	// share of their time, and one group at a time would serialise them.
	adaptiveSlow = 5 * time.Millisecond
	// adaptiveStuck is how long a function of a group may run before the
	// calls queued behind it run in transactions of their own: far above
	// AdaptiveGroupBudget, so that a pause of the process or the machine
	// does not scatter a deep queue.
	adaptiveStuck = 5 * AdaptiveGroupBudget
	// estimateWindow is how many recent functions the estimate is the
	// median of; estimateStale how long a slow estimate holds without new
	// measurements.
	estimateWindow = 16
	estimateStale  = time.Second
)

type txGroup struct {
	s        *Store
	max      int // members of a group; 0: adaptive
	flushers int
	timeout  time.Duration

	// turn is held by the adaptive group running its statements (see
	// flushNext): capacity 1.
	turn chan struct{}

	mu     sync.Mutex
	queue  []*txOp
	active int
	solos  int // adaptive: calls running in transactions of their own
	closed bool
	wg     sync.WaitGroup

	stuck    atomic.Bool  // adaptive: a group's function has run past adaptiveStuck
	stuckAt  atomic.Int64 // adaptive: when a function last ran past adaptiveStuck, unix ns
	est      atomic.Int64 // adaptive: recent functions' duration, ns (see observe)
	last     atomic.Int64 // adaptive: the last function's duration, ns
	measured atomic.Int64 // adaptive: when est was last renewed, unix ns
	samples  atomic.Int64 // adaptive: how many durations est is the median of
	estMu    sync.Mutex
	recent   [estimateWindow]time.Duration // guarded by estMu
	next     int                           // guarded by estMu

	groups, grouped, alone, deferred atomic.Int64 // BatchStats
}

func newTxGroup(s *Store, cfg BatchConfig) *txGroup {
	g := &txGroup{s: s, max: cfg.GroupTx, flushers: cfg.GroupFlushers, timeout: cfg.Timeout, turn: make(chan struct{}, 1)}
	if g.max <= 1 {
		g.max = 0
	}
	return g
}

func (g *txGroup) adaptive() bool { return g.max == 0 }

// observe adds a function's duration to the estimate: the median of the
// last estimateWindow durations, so that a few functions that waited (for a
// lock another transaction held, for a core) do not make the tasks look
// slow, nor one slow first call (preparing its statements, say).
func (g *txGroup) observe(d time.Duration) {
	g.estMu.Lock()
	defer g.estMu.Unlock()
	g.recent[g.next%estimateWindow] = d
	g.next++
	n := min(g.next, estimateWindow)
	sorted := g.recent
	slices.Sort(sorted[:n])
	g.est.Store(int64(sorted[n/2]))
	g.last.Store(int64(d))
	g.samples.Store(int64(n))
	g.measured.Store(time.Now().UnixNano())
}

// timed wraps fn to measure it. In a group (inGroup), a function still
// running after adaptiveStuck sends the calls queued behind it to
// transactions of their own.
func (g *txGroup) timed(fn func(context.Context, pgx.Tx) ([]byte, error), inGroup bool) func(context.Context, pgx.Tx) ([]byte, error) {
	return func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		t0 := time.Now()
		if inGroup {
			defer g.watchStuck()()
		}
		defer func() {
			if !deferredIn(ctx) {
				g.observe(time.Since(t0))
			}
		}()
		return fn(ctx, tx)
	}
}

// watchStuck starts watching work of a group that others wait behind (a
// function, or the statements the functions deferred): once it has run
// for adaptiveStuck, the calls queued behind it run alone, until the
// returned func, called as it ends, stops the watch.
func (g *txGroup) watchStuck() func() {
	ended := false // guarded by g.mu
	t := time.AfterFunc(adaptiveStuck, func() { g.releaseQueued(&ended) })
	return func() {
		t.Stop()
		g.mu.Lock()
		defer g.mu.Unlock()
		ended = true
		g.stuck.Store(false)
	}
}

// fresh reports whether the estimate can be trusted: two measurements at
// least (the first call on a connection prepares its statements), the
// last within estimateStale. A stale or missing estimate makes groups of
// one, probes (see size).
func (g *txGroup) fresh() bool {
	return g.samples.Load() >= 2 && time.Since(time.Unix(0, g.measured.Load())) < estimateStale
}

// slow reports whether recent functions were slow, the last one too: calls
// run alone. Recent functions are slow when their estimate is, over three
// measurements at least (the first calls on new connections prepare their
// statements, and two of them alone do not make the tasks slow), or when a
// function ran past adaptiveStuck within estimateStale (the functions of a
// group taken before then are fast no more). The durations of calls run
// alone are not measured (beside each other they would measure each
// other's lock waits too): once the estimate is stale, a probe measures
// again, and a fast one ends it.
func (g *txGroup) slow() bool {
	if !g.fresh() || time.Duration(g.last.Load()) < adaptiveSlow {
		return false
	}
	if g.samples.Load() >= 3 && time.Duration(g.est.Load()) >= adaptiveSlow {
		return true
	}
	return time.Since(time.Unix(0, g.stuckAt.Load())) < estimateStale
}

// releaseQueued answers every queued call "run alone", and makes the calls
// that come run alone until the function returns (ended): the group's
// running function is slow.
func (g *txGroup) releaseQueued(ended *bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if *ended {
		return // it returned as the timer fired
	}
	g.stuck.Store(true)
	g.stuckAt.Store(time.Now().UnixNano())
	for _, op := range g.queue {
		if op.state == opQueued {
			op.state = opCancelled // dropped from the queue by the next take
			g.solos++
			op.done <- txResult{alone: true}
		}
	}
}

// size is the most members of the next group.
func (g *txGroup) size() int {
	if !g.adaptive() {
		return g.max
	}
	est := time.Duration(g.est.Load())
	if !g.fresh() || est <= 0 {
		return 1 // a probe
	}
	return int(min(adaptiveMax, max(2, int64(AdaptiveGroupBudget/est))))
}

// solo runs one call in a transaction of its own, counted among the solos;
// timed says whether its function's duration counts in the estimate.
func (g *txGroup) solo(ctx context.Context, p ClaimParams, fn func(context.Context, pgx.Tx) ([]byte, error), timed bool) (Claim, error) {
	g.alone.Add(1)
	defer func() {
		g.mu.Lock()
		g.solos--
		g.mu.Unlock()
	}()
	if timed {
		fn = g.timed(fn, false)
	}
	return g.s.runSolo(ctx, p, fn)
}

// close waits for the running groups; calls still queued fail with
// ErrClosed.
func (g *txGroup) close() {
	g.mu.Lock()
	g.closed = true
	g.mu.Unlock()
	g.wg.Wait()
	// Under the lock, as a caller's cancel marks its op (done has room for
	// the one answer).
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, op := range g.queue {
		if op.state == opQueued {
			op.state = opTaken
			op.done <- txResult{err: ErrClosed}
		}
	}
	g.queue = nil
}

func (g *txGroup) run(ctx context.Context, p ClaimParams, fn func(context.Context, pgx.Tx) ([]byte, error)) (Claim, error) {
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		return Claim{}, ErrClosed
	}
	if g.adaptive() {
		lone := g.solos == 0 && g.active == 0 && len(g.queue) == 0
		if lone || g.slow() || g.stuck.Load() {
			// Alone, slow, or behind a function that runs long: at once, in
			// a transaction of its own. The estimate counts the lone only:
			// the others run beside each other and may wait for each
			// other's locks.
			g.solos++
			g.mu.Unlock()
			return g.solo(ctx, p, fn, lone)
		}
	}
	op := &txOp{ctx: ctx, p: p, fn: fn, done: make(chan txResult, 1)}
	if g.adaptive() {
		op.fn = g.timed(fn, true)
	}
	g.queue = append(g.queue, op)
	lead := g.active < g.flushers
	if lead {
		g.active++
		g.wg.Add(1)
	}
	g.mu.Unlock()
	if lead {
		g.lead(op)
	}
	var r txResult
	select {
	case r = <-op.done:
	case <-ctx.Done():
		g.mu.Lock()
		queued := op.state == opQueued
		if queued {
			op.state = opCancelled
		}
		g.mu.Unlock()
		if queued {
			return Claim{}, fmt.Errorf("run tx: %w", context.Cause(ctx))
		}
		// Taken by a flusher: its answer comes (the function sees ctx).
		r = <-op.done
	}
	if r.alone {
		return g.solo(ctx, p, fn, false)
	}
	return r.c, r.err
}

// lead runs groups in the caller's goroutine until its own op is answered,
// then hands the rest of the queue to a goroutine of its own. An adaptive
// leader that finds the turn taken hands over at once too: the caller
// waits for its answer, not for the turn, so that a call released to run
// alone (releaseQueued) is not held behind the group that has the turn.
func (g *txGroup) lead(mine *txOp) {
	for {
		if g.adaptive() {
			select {
			case g.turn <- struct{}{}:
			default:
				go g.flushAll()
				return
			}
		}
		if !g.flushNext(true) {
			return
		}
		g.mu.Lock()
		own := mine.state != opQueued
		g.mu.Unlock()
		if own {
			go g.flushAll()
			return
		}
	}
}

// flushAll runs groups until there is nothing to take.
func (g *txGroup) flushAll() {
	for g.flushNext(false) {
	}
}

// flushNext takes one group and runs it; false when there was nothing to
// take (the flusher slot is given up). An adaptive group takes its members
// once it has the turn (so that it holds all that queued while the last
// group ran; haveTurn: the caller took it) and gives the turn up as it
// commits (flush, runSoloTx).
func (g *txGroup) flushNext(haveTurn bool) bool {
	release := func() {}
	if g.adaptive() {
		if !haveTurn {
			g.turn <- struct{}{}
		}
		release = sync.OnceFunc(func() { <-g.turn })
	}
	defer release()
	ops := g.take()
	if len(ops) == 0 {
		g.wg.Done()
		return false
	}
	if len(ops) == 1 && g.adaptive() {
		// Alone: a transaction of its own costs less than a group's.
		op := ops[0]
		g.alone.Add(1)
		c, err := g.s.runSoloTx(op.ctx, op.p, op.fn, release)
		op.done <- txResult{c: c, err: err}
		return true
	}
	g.groups.Add(1)
	g.grouped.Add(int64(len(ops)))
	g.flush(ops, release)
	return true
}

// take removes up to max queued ops, one per key, sorted by task and key so
// that concurrent groups take their claims' row locks in one order. With
// nothing to take it gives up the flusher slot.
func (g *txGroup) take() []*txOp {
	g.mu.Lock()
	defer g.mu.Unlock()
	ops, rest := takeFrom(g.queue, g.size(), map[opKey]bool{})
	g.queue = rest
	if len(ops) == 0 {
		g.active--
	}
	slices.SortFunc(ops, func(a, b *txOp) int {
		return cmp.Or(cmp.Compare(a.p.Task, b.p.Task), cmp.Compare(a.p.Key, b.p.Key))
	})
	return ops
}

// member is one op's progress through a group.
type member struct {
	op       *txOp
	claim    Claim
	result   []byte        // what its function returned; as the record keeps it once checked
	deferred *Deferred     // the statement its function deferred, run after the functions
	took     time.Duration // how long its function took, when it deferred
	res      *string       // the checked result as text, for the completion
	commit   bool          // its claim (and, when first, its effect) commits with the group
	done     bool          // its turn in the group is over
	ran      bool          // its function returned without an error
	invoked  bool          // its function was called
	err      error         // its own answer when it does not commit
}

// flush runs one group and answers every op of it. committing is called
// as the group's transaction commits, once it takes no more locks.
func (g *txGroup) flush(ops []*txOp, committing func()) {
	ms := make([]*member, len(ops))
	for i, op := range ops {
		ms[i] = &member{op: op}
	}
	gctx, cancel := context.WithTimeout(context.Background(), g.timeout)
	defer cancel()
	err := g.write(gctx, ms, committing)
	for _, m := range ms {
		switch {
		case !m.commit:
			m.op.done <- txResult{c: m.claim, err: m.err}
		case err != nil:
			m.op.done <- txResult{err: err}
		default:
			c := m.claim
			if c.Outcome == OutcomeFirst {
				c.Status, c.Result, c.LeaseUntil = StatusCompleted, m.result, time.Time{}
			}
			m.op.done <- txResult{c: c}
		}
	}
}

// write runs the group's transaction. Its error belongs to every member
// marked commit. It tries the fast path first: one claim statement for the
// whole group, then the functions one after another without savepoints.
// When that cannot finish (a function failed, a claim was refused, the
// connection went), its transaction is rolled back and the group runs again
// member by member, each in a savepoint, so that one failure stays its own:
// a function may then run a second time, its first effects rolled back.
func (g *txGroup) write(ctx context.Context, ms []*member, committing func()) error {
	if done, err := g.writeBatched(ctx, ms, committing); done {
		return err
	}
	for _, m := range ms {
		*m = member{op: m.op}
		m.op.newAttempt()
	}
	return g.writeEach(ctx, ms, committing)
}

// lose marks every member that was to commit, or had not had its turn,
// failed by err: the transaction tx is gone and nothing of it commits
// (unless a function committed part of it: chained).
func (g *txGroup) lose(ctx context.Context, tx pgx.Tx, ms []*member, what string, err error) error {
	g.s.log.Warn("idempotency transaction group lost", zap.String("step", what), zap.Error(err))
	if g.chained(ctx, tx, ms) {
		return nil
	}
	for _, m := range ms {
		if m.commit || !m.done {
			m.commit, m.claim, m.err = false, Claim{}, fmt.Errorf("run tx: %s: %w", what, err)
		}
	}
	return nil
}

// writeBatched is write's fast path; done is false when the group must run
// member by member instead (nothing of this attempt commits then).
func (g *txGroup) writeBatched(ctx context.Context, ms []*member, committing func()) (done bool, err error) {
	var live []*member
	for _, m := range ms {
		if m.op.p.AllowMismatch {
			return false, nil // the batch statement refuses a mismatch for all
		}
		if m.op.ctx.Err() == nil {
			live = append(live, m)
		}
	}
	if len(live) < 2 {
		return false, nil // alone, the savepoint path costs the same
	}
	tx, err := g.s.pool.Begin(ctx)
	if err != nil {
		return false, nil
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	byKey, txid, err := g.claimAll(ctx, tx, live)
	if err != nil {
		return false, nil
	}
	for _, m := range live {
		r, ok := byKey[m.op.key()]
		if !ok {
			return false, nil
		}
		m.claim, m.commit = r.claim(m.op.p.Token), true
	}
	var pending []*member // deferred their statements (Defer)
	for _, m := range live {
		if m.claim.Outcome != OutcomeFirst {
			continue // answered after the commit, which keeps the duplicate count
		}
		misused, ferr := m.runDeferring(tx, !g.s.plainArrays)
		if endedTx(tx) {
			// The members whose statements wait have not run: ended runs
			// them again, in transactions of their own. This one, had it
			// deferred its statement, may have written before it ended the
			// transaction: it fails, held, as one that failed after it.
			if m.deferred != nil && ferr == nil {
				ferr = &TaskTxError{What: "the task deferred its statement and ended its transaction itself"}
			}
			_ = tx.Rollback(context.WithoutCancel(ctx)) // its connection, for the runs ended needs
			g.ended(ctx, ms, m, ferr)
			return true, nil
		}
		if ferr != nil || misused || failedTx(tx) {
			// A function that failed, or returned with the transaction
			// failed (it caught its statement's error): member by member,
			// unless part of the transaction committed all the same.
			return g.chained(ctx, tx, ms), nil
		}
		if m.deferred != nil {
			pending = append(pending, m)
		}
	}
	if len(pending) > 0 {
		t0 := time.Now()
		stop := func() {}
		if g.adaptive() {
			stop = g.watchStuck()
		}
		sent, ended := sendDeferred(ctx, tx, pending)
		stop()
		if ended {
			g.endedByStatement(ctx, tx, ms, pending)
			return true, nil
		}
		if !sent {
			return g.chained(ctx, tx, ms), nil
		}
		g.deferred.Add(int64(len(pending)))
		if g.adaptive() {
			per := time.Since(t0) / time.Duration(len(pending))
			for _, m := range pending {
				g.observe(m.took + per)
			}
		}
	}
	for _, m := range ms {
		m.done = true
		if !m.commit {
			m.err = fmt.Errorf("run tx: %w", context.Cause(m.op.ctx))
		}
	}
	return true, g.finish(ctx, tx, ms, committing, txid)
}

// currentTxSQL is the transaction's id: a function that commits the group's
// transaction and goes on in a new one (COMMIT AND CHAIN) changes it.
const currentTxSQL = "SELECT pg_current_xact_id()::text"

// claimAll claims the live members in tx in one statement, and returns the
// claims by key and tx's id, in the same round trip.
func (g *txGroup) claimAll(ctx context.Context, tx pgx.Tx, live []*member) (map[opKey]claimRow, string, error) {
	b := &pgx.Batch{}
	b.Queue(g.s.q.claimBatchTx, g.s.batchArgs(claimBatchArgs(len(live), func(i int) ClaimParams { return live[i].op.p.inTx() }))...)
	b.Queue(currentTxSQL)
	br := tx.SendBatch(ctx, b)
	defer br.Close()
	rows, err := br.Query()
	if err != nil {
		return nil, "", err
	}
	byKey, err := scanClaimRows(rows, len(live))
	if err != nil {
		return nil, "", err
	}
	var txid string
	if err := br.QueryRow().Scan(&txid); err != nil {
		return nil, "", err
	}
	return byKey, txid, br.Close()
}

// writeEach runs the group member by member, each in a savepoint.
func (g *txGroup) writeEach(ctx context.Context, ms []*member, committing func()) (err error) {
	tx, err := g.s.pool.Begin(ctx)
	if err != nil {
		for _, m := range ms {
			m.commit, m.err = false, fmt.Errorf("run tx: begin: %w", err)
		}
		return nil
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	lost := func(what string, err error) error { return g.lose(ctx, tx, ms, what, err) }
	for _, m := range ms {
		m.done = true
		if cerr := m.op.ctx.Err(); cerr != nil {
			m.err = fmt.Errorf("run tx: %w", context.Cause(m.op.ctx))
			continue
		}
		// The savepoint and the claim in one round trip.
		b := &pgx.Batch{}
		b.Queue("SAVEPOINT onceler_task")
		b.Queue(g.s.q.claimOneTx, m.op.p.Task, m.op.p.Key, string(m.op.p.Token), m.op.p.Owner, m.op.p.TaskID,
			m.op.p.Fingerprint, m.op.p.Lease.Microseconds(), m.op.p.inTx().Message, false, m.op.p.AllowMismatch)
		br := tx.SendBatch(ctx, b)
		_, serr := br.Exec()
		var row claimRow
		cerr := serr
		if cerr == nil {
			cerr = row.scan(br.QueryRow())
		}
		if berr := br.Close(); cerr == nil {
			cerr = berr
		}
		if cerr != nil {
			if !isServerError(cerr) {
				return lost("claim", cerr)
			}
			if _, rerr := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT onceler_task"); rerr != nil {
				return lost("rollback to savepoint", rerr)
			}
			m.err = fmt.Errorf("run tx: claim: %w", cerr)
			continue
		}
		m.claim = row.claim(m.op.p.Token)
		m.commit = true
		if m.claim.Outcome != OutcomeFirst {
			continue // answered after the commit, which keeps the duplicate count
		}
		ferr := m.run(tx)
		if endedTx(tx) {
			_ = tx.Rollback(context.WithoutCancel(ctx))
			g.ended(ctx, ms, m, ferr)
			return nil
		}
		if ferr == nil {
			// Releasing the savepoint keeps the next member's rollback to its
			// own, and finds a function that returned but left the
			// transaction aborted (it caught its statement's error): that
			// member fails, as its completion would in a transaction of its
			// own, and the others go on.
			if _, rerr := tx.Exec(ctx, "RELEASE SAVEPOINT onceler_task"); rerr != nil {
				if !isServerError(rerr) {
					return lost("release savepoint", rerr)
				}
				ferr = &TaskTxError{What: "the task returned without an error, but one of its statements failed its transaction", Err: rerr}
			}
		}
		if ferr != nil {
			// As in a transaction of its own: no record, no effect.
			m.commit, m.claim, m.err = false, Claim{}, ferr
			if _, rerr := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT onceler_task"); rerr != nil {
				return lost("rollback to savepoint", rerr)
			}
			continue
		}
	}
	return g.finish(ctx, tx, ms, committing, "")
}

// run runs the member's function in tx and keeps its result.
func (m *member) run(tx pgx.Tx) error {
	m.invoked = true
	result, err := m.op.fn(m.op.ctx, tx)
	if err != nil {
		return err
	}
	return m.keep(result)
}

// runDeferring runs the member's function in tx. When offer is true it may
// defer its statement (Defer): then m.deferred holds it, and the member
// has not run until the statement has (sendDeferred). misused: it
// deferred twice. The group offers no deferral when the pool's connections
// use the simple protocol, which runs several statements sent as one.
func (m *member) runDeferring(tx pgx.Tx, offer bool) (misused bool, err error) {
	if !offer {
		return false, m.run(tx)
	}
	m.invoked = true
	ctx, slot := withDeferral(m.op.ctx)
	t0 := time.Now()
	result, err := m.op.fn(ctx, usedTx{Tx: tx, slot: slot})
	took := time.Since(t0)
	d, misused := slot.close()
	if err != nil || misused {
		return misused, err
	}
	if d != nil {
		m.deferred, m.result, m.took = d, result, took
		return false, nil
	}
	return false, m.keep(result)
}

// keep keeps a result of the member's function: it ran.
func (m *member) keep(result []byte) error {
	m.result = result
	m.ran = true
	stored, res, err := checkResult(result)
	if err != nil {
		return fmt.Errorf("run tx: %w", err)
	}
	m.result, m.res = stored, res
	return nil
}

// ended answers every member of a group whose transaction the function of
// member by ended itself (it ran COMMIT or ROLLBACK; byErr is what that
// function returned). What committed is found through the record: a
// member that ran and whose claim committed is completed outside the
// transaction (its effect committed with its claim); a member whose claim
// did not commit, or whose turn had not come, runs again in a transaction
// of its own (a claim that committed without its effect is released first:
// rerunOwn).
func (g *txGroup) ended(ctx context.Context, ms []*member, by *member, byErr error) {
	s := g.s
	for _, m := range ms {
		m.done = true
		switch {
		case m == by && byErr != nil:
			s.endedByTask(ctx, m.op.p.Ref(m.claim.Token), m.op.p.heldMessage)
			m.commit, m.claim, m.err = false, Claim{}, byErr
		case m == by:
			m.claim, m.err = s.completeEnded(ctx, m.op.p, m.claim, m.result)
			m.commit = false
		case m.commit && m.claim.Outcome != OutcomeFirst:
			m.commit = false // answered as found: the claim statement's answer
		case m.commit && m.ran:
			m.commit = false
			stored, err := s.Complete(ctx, m.op.p.Ref(m.claim.Token), m.result)
			if err == nil {
				m.claim.Status, m.claim.Result, m.claim.LeaseUntil = StatusCompleted, stored, time.Time{}
				continue
			}
			if !errors.Is(err, ErrNotFound) && !errors.Is(err, ErrFenced) {
				// Unknown: its redelivery finds the claim (and, past its
				// lease, holds it).
				m.claim, m.err = Claim{}, err
				continue
			}
			fallthrough // rolled back: nothing of it committed
		case m.err == nil:
			// Its claim may have committed with the group's first part,
			// without an effect.
			g.rerunOwn(ctx, m)
		}
	}
}

// endedByStatement answers a group whose transaction a deferred statement
// ended or changed: what of the group committed is not known for sure
// (the claims and effects before the statement may have, those after it
// did not), so the operations of the deferred statements whose claims
// committed are held, as that of a task that ended its transaction itself,
// and fail as the task's error; those whose claims did not commit run
// again on their own, where nothing is deferred; the members whose
// functions ran their statements themselves are answered as ended answers
// them. The group's transaction is rolled back first: what it still holds
// (after a statement that changed it without ending it) does not commit.
func (g *txGroup) endedByStatement(ctx context.Context, tx pgx.Tx, ms, pending []*member) {
	g.s.log.Error("a statement deferred to a transaction group ended the group's transaction", zap.Int("deferred", len(pending)))
	_ = tx.Rollback(context.WithoutCancel(ctx))
	for _, m := range pending {
		m.ran = false
		if g.s.holdEnded(ctx, m.op.p.Ref(m.claim.Token), m.op.p.heldMessage,
			"a statement of its transaction group ended the group's transaction: its effect may have committed") {
			m.commit, m.claim = false, Claim{}
			m.err = &TaskTxError{What: "a statement of its transaction group (Defer) ended the group's transaction"}
		}
	}
	g.ended(ctx, ms, nil, nil)
}

// endedTx reports whether tx's connection is no longer in a transaction: a
// function ran COMMIT or ROLLBACK on it.
func endedTx(tx pgx.Tx) bool {
	return !tx.Conn().IsClosed() && tx.Conn().PgConn().TxStatus() == 'I'
}

// finish completes the group's first claims and commits; committing is
// called just before the commit. txid, when not empty, is the id tx had
// when the group claimed: a function that ended tx and went on in a new
// transaction (COMMIT or ROLLBACK AND CHAIN) changed it, and the group
// rolls back and runs again as rerunSolo says. (In the member-by-member
// path each function runs in a savepoint, which such a function destroys:
// its release fails.)
func (g *txGroup) finish(ctx context.Context, tx pgx.Tx, ms []*member, committing func(), txid string) error {
	lost := func(what string, err error) error { return g.lose(ctx, tx, ms, what, err) }
	var firsts []*member
	for _, m := range ms {
		if m.commit && m.claim.Outcome == OutcomeFirst {
			firsts = append(firsts, m)
		}
	}
	// The group takes no more locks but its own records' (its claims hold
	// them): the next group may run its functions.
	committing()
	if len(firsts) > 0 {
		// All completions in one statement, as a flush of the batcher
		// writes them: the records are this transaction's own, locked by
		// its claims.
		b := &pgx.Batch{}
		if txid != "" {
			b.Queue(currentTxSQL)
		}
		b.Queue(g.s.q.completeBatch, g.s.batchArgs(completeBatchArgs(len(firsts), func(i int) (Ref, *string) {
			return firsts[i].op.p.Ref(firsts[i].claim.Token), firsts[i].res
		}))...)
		br := tx.SendBatch(ctx, b)
		if txid != "" {
			var now string
			if err := br.QueryRow().Scan(&now); err != nil {
				_ = br.Close()
				return lost("complete", err)
			}
			if now != txid {
				_ = br.Close()
				g.s.log.Error("a function ended its transaction group's transaction and went on in a new one; its members run again one by one")
				if !g.chained(ctx, tx, ms) {
					g.rerunSolo(ms)
				}
				return nil
			}
		}
		rs, err := br.Query()
		if err != nil {
			_ = br.Close()
			return lost("complete", err)
		}
		done, err := scanCompletedKeys(rs, len(firsts))
		if cerr := br.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return lost("complete", err)
		}
		for _, m := range firsts {
			if !done[m.op.key()] {
				// A claim of the group's own is gone from its transaction: a
				// function ended it (a ROLLBACK AND CHAIN in a string of
				// statements). Nothing of the group commits; each member
				// runs again in a transaction of its own.
				g.s.log.Warn("a function ended its transaction group's transaction; its members run again one by one")
				if !g.chained(ctx, tx, ms) {
					g.rerunSolo(ms)
				}
				return nil
			}
		}
	}
	if !slices.ContainsFunc(ms, func(m *member) bool { return m.commit }) {
		return nil
	}
	if err := tx.Commit(ctx); err != nil {
		if refusedCommit(err) {
			// Refused for what a task wrote (a deferred constraint): the
			// group rolled back; each member runs again in a transaction of
			// its own, where the refusal is that task's alone.
			g.s.log.Info("transaction group's commit refused; its members run again one by one", zap.Error(err))
			// Nothing of it committed before: the transaction's id held
			// to the completion (or each function's savepoint was released).
			g.rerunSolo(ms)
			return nil
		}
		return writeError("run tx: commit", err)
	}
	return nil
}

// rerunSolo runs every member that was to commit again, each in a
// transaction of its own: the group's transaction rolled back, and nothing
// of it committed.
func (g *txGroup) rerunSolo(ms []*member) {
	for _, m := range ms {
		if m.commit {
			m.commit = false
			m.op.newAttempt()
			m.claim, m.err = g.s.runSolo(m.op.ctx, m.op.p, m.op.fn)
		}
	}
}

// failedTx reports whether tx is in a failed state: a statement in it
// failed, and the server refuses all but a rollback.
func failedTx(tx pgx.Tx) bool { return tx.Conn().PgConn().TxStatus() == 'E' }

// isServerError reports an error the server answered with: the connection
// and the transaction (after a rollback to a savepoint) are still usable.
func isServerError(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr)
}
