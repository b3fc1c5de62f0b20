package idempotency

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"go.uber.org/zap"
)

// The batcher is a group commit: Claim and Complete calls queue up, and a
// flusher takes what is queued (at most MaxSize of each kind, one per key)
// and writes it as one claim statement and one completion statement (the
// function complete_batch, migration 0005), sent as one pipeline with a
// single Sync, so they commit together in one implicit transaction. There
// is no fixed wait: when no flush is running, the caller itself leads at
// once (flushing its own call and whatever else queued), so an idle store
// answers a lone call in one round trip; while flushes run, new calls
// queue for the next one. With Flushers above 1 (the default is 1), a
// further flush (each on its own connection) starts only once as many
// calls are queued as the flush last taken carried: two flushes then
// overlap one's commit with the other's statements, and batches stay as
// large as the load allows. A leader whose own call is answered hands the
// rest of the queue to a background flusher.

type opState int

const (
	opQueued opState = iota
	opTaken
	opCancelled
)

type claimOp struct {
	p     ClaimParams
	state opState // guarded by batcher.mu
	done  chan claimResult
}

type claimResult struct {
	c   Claim
	err error
}

type completeOp struct {
	ref    Ref
	result *string
	state  opState // guarded by batcher.mu
	done   chan completeResult
}

// batchOp is a queued claim or completion, as take sees it.
type batchOp interface {
	key() opKey
	stateRef() *opState
}

func (op *claimOp) key() opKey            { return opKey{op.p.Task, op.p.Key} }
func (op *claimOp) stateRef() *opState    { return &op.state }
func (op *completeOp) key() opKey         { return opKey{op.ref.Task, op.ref.Key} }
func (op *completeOp) stateRef() *opState { return &op.state }

// takeFrom takes up to max ops of queue, at most one per key, and marks them
// taken; cancelled ops are dropped and the others stay queued, in order, in
// rest (which reuses queue's array). seen is scratch space.
func takeFrom[T batchOp](queue []T, max int, seen map[opKey]bool) (taken, rest []T) {
	clear(seen)
	rest = queue[:0]
	for _, op := range queue {
		st := op.stateRef()
		switch k := op.key(); {
		case *st == opCancelled:
		case len(taken) >= max || seen[k]:
			rest = append(rest, op)
		default:
			seen[k] = true
			*st = opTaken
			taken = append(taken, op)
		}
	}
	clear(queue[len(rest):])
	return taken, rest
}

type completeResult struct {
	ok  bool
	err error
}

type opKey struct{ task, key string }

type batcher struct {
	s   *Store
	cfg BatchConfig

	mu        sync.Mutex
	claims    []*claimOp
	completes []*completeOp
	active    int // flushes running or handed off, at most cfg.Flushers
	lastTaken int // calls in the flush last taken
	closed    bool

	flushes, rows atomic.Int64

	arrive  chan struct{} // capacity 1: a call was queued
	handoff chan struct{} // capacity cfg.Flushers >= handoffs outstanding
	quit    chan struct{}
	wg      sync.WaitGroup
}

func newBatcher(s *Store, cfg BatchConfig) *batcher {
	b := &batcher{s: s, cfg: cfg, arrive: make(chan struct{}, 1), handoff: make(chan struct{}, cfg.Flushers), quit: make(chan struct{})}
	for range cfg.Flushers {
		b.wg.Go(b.run)
	}
	return b
}

func (b *batcher) close() {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return
	}
	b.closed = true
	b.mu.Unlock()
	close(b.quit)
	b.wg.Wait()
	// Under the lock, as a caller's cancel marks its op (done has room for
	// the one answer, so nothing blocks).
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, op := range b.claims {
		if op.state == opQueued {
			op.state = opTaken
			op.done <- claimResult{err: ErrClosed}
		}
	}
	for _, op := range b.completes {
		if op.state == opQueued {
			op.state = opTaken
			op.done <- completeResult{err: ErrClosed}
		}
	}
	b.claims, b.completes = nil, nil
}

// enqueue adds an op under the lock and says whether the caller leads: when
// no flush runs, or when another may start and the queue holds as many calls
// as the last flush took.
func (b *batcher) enqueue(add func()) (lead bool, err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return false, ErrClosed
	}
	add()
	select {
	case b.arrive <- struct{}{}:
	default:
	}
	if b.active == 0 || (b.active < b.cfg.Flushers && len(b.claims)+len(b.completes) >= b.lastTaken) {
		b.active++
		return true, nil
	}
	return false, nil
}

func (b *batcher) claim(ctx context.Context, p ClaimParams) (Claim, error) {
	op := &claimOp{p: p, done: make(chan claimResult, 1)}
	r, err := submit(ctx, b, "claim", func() { b.claims = append(b.claims, op) }, &op.state, op.done)
	if err != nil {
		return Claim{}, err
	}
	return r.c, r.err
}

func (b *batcher) complete(ctx context.Context, ref Ref, res *string) (bool, error) {
	op := &completeOp{ref: ref, result: res, done: make(chan completeResult, 1)}
	r, err := submit(ctx, b, "complete", func() { b.completes = append(b.completes, op) }, &op.state, op.done)
	if err != nil {
		return false, err
	}
	return r.ok, r.err
}

// submit queues an op (add appends it, under the lock), flushes when it
// leads, and waits for the op's answer on done. When ctx ends first, an op
// still queued is withdrawn (ctx's cause, wrapped as what); one a flusher
// took has an unknown outcome, unless its answer came meanwhile.
func submit[R any](ctx context.Context, b *batcher, what string, add func(), st *opState, done <-chan R) (R, error) {
	var zero R
	lead, err := b.enqueue(add)
	if err != nil {
		return zero, err
	}
	if lead {
		b.lead(st)
	}
	select {
	case r := <-done:
		return r, nil
	case <-ctx.Done():
		if b.cancel(st) {
			return zero, fmt.Errorf("%s: %w", what, context.Cause(ctx))
		}
		select {
		case r := <-done: // answered meanwhile
			return r, nil
		default:
		}
		return zero, fmt.Errorf("%s: %w", what, &unknownError{err: context.Cause(ctx)})
	}
}

// cancel marks a queued op cancelled; false when a flusher already took it.
func (b *batcher) cancel(st *opState) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if *st == opQueued {
		*st = opCancelled
		return true
	}
	return false
}

// lead flushes in the caller's goroutine until the caller's own op is
// answered, then hands what is left to a background flusher. A flush runs on
// the batcher's own context (bounded by BatchConfig.Timeout), not the
// caller's, since it carries other callers' writes.
func (b *batcher) lead(mine *opState) {
	for {
		claims, completes := b.take()
		if len(claims) == 0 && len(completes) == 0 {
			return // take gave up the slot
		}
		b.flush(claims, completes)
		b.mu.Lock()
		if *mine == opQueued {
			b.mu.Unlock()
			continue
		}
		if len(b.claims) == 0 && len(b.completes) == 0 {
			b.active--
			b.mu.Unlock()
			return
		}
		b.mu.Unlock()
		b.handoff <- struct{}{}
		return
	}
}

// run is a background flusher: it takes over a leader's slot and flushes
// until the queue is empty.
func (b *batcher) run() {
	for {
		select {
		case <-b.quit:
			return
		case <-b.handoff:
		}
		for {
			claims, completes := b.take()
			if len(claims) == 0 && len(completes) == 0 {
				break
			}
			b.flush(claims, completes)
		}
	}
}

// gather waits, up to BatchConfig.Linger, while the queue holds some calls
// but fewer than the last flush carried: the callers that flush answered
// are on their way back with their next calls (a completion after its
// claim), and a flush that waits for them carries them all, where one that
// went at once would carry a few and leave the rest for another commit.
// A lone call on an idle store does not wait (the last flush carried one);
// the first after a busy spell waits once, Linger at most.
func (b *batcher) gather() {
	if b.cfg.Linger <= 0 {
		return
	}
	var deadline time.Time
	for {
		b.mu.Lock()
		n, want := len(b.claims)+len(b.completes), b.lastTaken
		b.mu.Unlock()
		if n == 0 || n >= want {
			return
		}
		now := time.Now()
		if deadline.IsZero() {
			deadline = now.Add(b.cfg.Linger)
		}
		left := deadline.Sub(now)
		if left <= 0 {
			return
		}
		t := time.NewTimer(left)
		select {
		case <-b.arrive:
		case <-t.C:
		}
		t.Stop()
	}
}

// take removes up to MaxSize claims and completions from the queue, at most
// one per key of each kind (repeats wait for the next flush, which sees
// this one's outcome). When there is nothing to take, it gives up the
// caller's flusher slot.
func (b *batcher) take() ([]*claimOp, []*completeOp) {
	b.gather()
	b.mu.Lock()
	defer b.mu.Unlock()
	seen := map[opKey]bool{}
	claims, rest := takeFrom(b.claims, b.cfg.MaxSize, seen)
	b.claims = rest
	completes, crest := takeFrom(b.completes, b.cfg.MaxSize, seen)
	b.completes = crest
	if len(claims) == 0 && len(completes) == 0 {
		b.active--
		return nil, nil
	}
	b.lastTaken = len(claims) + len(completes)
	b.flushes.Add(1)
	b.rows.Add(int64(len(claims) + len(completes)))
	return claims, completes
}

func (b *batcher) fail(claims []*claimOp, completes []*completeOp, err error) {
	for _, op := range claims {
		select {
		case op.done <- claimResult{err: err}:
		default:
		}
	}
	for _, op := range completes {
		select {
		case op.done <- completeResult{err: err}:
		default:
		}
	}
}

// flush writes one batch, retrying a deadlock or serialization failure
// (the whole implicit transaction rolled back), and answers every caller.
func (b *batcher) flush(claims []*claimOp, completes []*completeOp) {
	var err error
	for attempt := range 3 {
		var cr map[opKey]claimRow
		var ck map[opKey]bool
		cr, ck, err = b.write(claims, completes)
		if err == nil {
			b.answer(claims, completes, cr, ck)
			return
		}
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || (pgErr.Code != "40P01" && pgErr.Code != "40001") {
			break
		}
		b.s.log.Debug("idempotency batch conflict, retrying", zap.Int("attempt", attempt+1), zap.Error(err))
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && len(claims)+len(completes) > 1 {
		// The server refused the batch and rolled it back: one bad call
		// must not fail the others, so write each on its own.
		b.s.log.Warn("idempotency batch refused, writing its calls one by one", zap.Error(err))
		for _, op := range claims {
			b.flush([]*claimOp{op}, nil)
		}
		for _, op := range completes {
			b.flush(nil, []*completeOp{op})
		}
		return
	}
	b.s.log.Warn("idempotency batch failed", zap.Int("claims", len(claims)),
		zap.Int("completes", len(completes)), zap.Error(err))
	b.fail(claims, completes, writeError("batch", err))
}

func (b *batcher) write(claims []*claimOp, completes []*completeOp) (map[opKey]claimRow, map[opKey]bool, error) {
	ctx, cancel := context.WithTimeout(context.Background(), b.cfg.Timeout)
	defer cancel()
	// A lone call (an idle store) takes the plain single-statement path.
	if len(claims) == 1 && len(completes) == 0 {
		r, err := b.s.claimRow(ctx, b.s.pool, claims[0].p, false)
		return map[opKey]claimRow{claims[0].key(): r}, nil, err
	}
	if len(claims) == 0 && len(completes) == 1 {
		op := completes[0]
		ok, err := b.s.completeRaw(ctx, b.s.pool, op.ref, op.result)
		return nil, map[opKey]bool{{op.ref.Task, op.ref.Key}: ok}, err
	}
	batch := &pgx.Batch{}
	if len(claims) > 0 {
		batch.Queue(b.s.q.claimBatch, b.s.batchArgs(claimBatchArgs(len(claims), func(i int) ClaimParams { return claims[i].p }))...)
	}
	if len(completes) > 0 {
		batch.Queue(b.s.q.completeBatch, b.s.batchArgs(completeBatchArgs(len(completes), func(i int) (Ref, *string) {
			return completes[i].ref, completes[i].result
		}))...)
	}
	res := b.s.pool.SendBatch(ctx, batch)
	var rows map[opKey]claimRow
	var completed map[opKey]bool
	err := func() error {
		if len(claims) > 0 {
			rs, err := res.Query()
			if err != nil {
				return err
			}
			if rows, err = scanClaimRows(rs, len(claims)); err != nil {
				return err
			}
		}
		if len(completes) == 0 {
			return nil
		}
		rs, err := res.Query()
		if err != nil {
			return err
		}
		completed, err = scanCompletedKeys(rs, len(completes))
		return err
	}()
	// Close reads up to ReadyForQuery: only then has the transaction committed.
	if cerr := res.Close(); err == nil {
		err = cerr
	}
	return rows, completed, err
}

func (b *batcher) answer(claims []*claimOp, completes []*completeOp, rows map[opKey]claimRow, completed map[opKey]bool) {
	for _, op := range claims {
		r, ok := rows[op.key()]
		if !ok {
			op.done <- claimResult{err: errors.New("idempotency: batch returned no row for a claim")}
			continue
		}
		op.done <- claimResult{c: r.claim(op.p.Token)}
	}
	for _, op := range completes {
		op.done <- completeResult{ok: completed[opKey{op.ref.Task, op.ref.Key}]}
	}
}

// completeBatchArgs are the arguments of the completeBatch statement for n
// completions; at(i) gives the i-th claim and its result.
func completeBatchArgs(n int, at func(int) (Ref, *string)) []any {
	tasks, keys, tokens, results := make(textArray, n), make(textArray, n), make(textArray, n), make([]*string, n)
	for i := range n {
		ref, res := at(i)
		tasks[i], keys[i], tokens[i], results[i] = ref.Task, ref.Key, string(ref.Token), res
	}
	return []any{tasks, keys, tokens, results}
}

// scanCompletedKeys reads the answer of the completeBatch statement: the
// records it completed (a claim missing from it was no longer current).
func scanCompletedKeys(rs pgx.Rows, n int) (map[opKey]bool, error) {
	defer rs.Close()
	completed := make(map[opKey]bool, n)
	var k opKey
	for rs.Next() {
		if err := rs.Scan(&k.task, &k.key); err != nil {
			return nil, err
		}
		completed[k] = true
	}
	return completed, rs.Err()
}

// claimBatchArgs are the arguments of the claimBatch statement for n claims;
// at(i) gives the i-th claim, with its token.
func claimBatchArgs(n int, at func(int) ClaimParams) []any {
	tasks, keys, tokens := make(textArray, n), make(textArray, n), make(textArray, n)
	owners, ids := make(textArray, n), make(textArray, n)
	fps, msgs := make([][]byte, n), make([][]byte, n)
	leases := make([]int64, n)
	for i := range n {
		p := at(i)
		tasks[i], keys[i], tokens[i] = p.Task, p.Key, string(p.Token)
		owners[i], ids[i] = p.Owner, p.TaskID
		fps[i], msgs[i], leases[i] = p.Fingerprint, p.Message, p.Lease.Microseconds()
		if fps[i] == nil {
			fps[i] = []byte{}
		}
	}
	return []any{tasks, keys, tokens, owners, ids, fps, leases, msgs}
}

// batchArgs are args as the pool's connections can send them: on those
// that encode arguments by their Go type alone (plainArrays), a textArray
// goes as the []string pgx knows.
func (s *Store) batchArgs(args []any) []any {
	if !s.plainArrays {
		return args
	}
	for i, a := range args {
		if t, ok := a.(textArray); ok {
			args[i] = []string(t)
		}
	}
	return args
}

// textArray is a text[] argument that pgx encodes without boxing each of
// its strings in an interface value, as it does for a []string (one
// allocation per element): its elements are textElems, a pointer each.
type textArray []string

func (a textArray) Dimensions() []pgtype.ArrayDimension {
	if a == nil {
		return nil
	}
	return []pgtype.ArrayDimension{{Length: int32(len(a)), LowerBound: 1}}
}

func (a textArray) Index(i int) any { return textElem{&a[i]} }

func (a textArray) IndexType() any { return textElem{new(string)} }

// textElem is one string of a textArray.
type textElem struct{ p *string }

func (e textElem) TextValue() (pgtype.Text, error) {
	return pgtype.Text{String: *e.p, Valid: true}, nil
}
