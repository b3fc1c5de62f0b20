package idempotency

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"
)

// checkResult returns result as the record stores it (StorableJSON) and
// as the text the statements write, or ErrInvalidResult. A nil result
// stays nil (no result).
func checkResult(result []byte) ([]byte, *string, error) {
	if result == nil {
		return nil, nil, nil
	}
	b, err := StorableJSON(result)
	if err != nil {
		return nil, nil, err
	}
	r := string(b)
	return b, &r, nil
}

// Complete records the operation as completed with its JSON result (nil
// for none) and returns the result as the record keeps it (StorableJSON:
// what a duplicate reads back), so that the caller answers with the same
// without converting it again. It fails with ErrFenced when ref.Token is
// no longer the current claim (taken over, failed, released); completing
// again with the same token is a no-op. An error that may have committed
// is ErrUnknownOutcome.
func (s *Store) Complete(ctx context.Context, ref Ref, result []byte) ([]byte, error) {
	stored, res, err := checkResult(result)
	if err != nil {
		return nil, fmt.Errorf("complete: %w", err)
	}
	var done bool
	if s.batch != nil {
		done, err = s.batch.complete(ctx, ref, res)
	} else {
		done, err = s.completeOne(ctx, s.pool, ref, res)
	}
	if err != nil {
		return nil, err
	}
	if !done {
		if err := s.checkFenced(ctx, ref, StatusCompleted); err != nil {
			return nil, err
		}
	}
	return stored, nil
}

func (s *Store) completeOne(ctx context.Context, q querier, ref Ref, res *string) (bool, error) {
	ok, err := s.completeRaw(ctx, q, ref, res)
	return ok, writeError("complete", err)
}

func (s *Store) completeRaw(ctx context.Context, q querier, ref Ref, res *string) (bool, error) {
	return scanCompleted(q.QueryRow(ctx, s.q.complete, s.completeArgs(ref, res)...))
}

func (s *Store) completeArgs(ref Ref, res *string) []any {
	return []any{ref.Task, ref.Key, string(ref.Token), res}
}

// scanCompleted reads the answer of one completion statement: whether it
// completed the record (false: the claim was not current).
func scanCompleted(row pgx.Row) (bool, error) {
	var ok bool
	err := row.Scan(&ok)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	return ok, err
}

// checkFenced explains why a write on ref changed no row: nil when the
// record already is in state done with ref's token (a repeated call),
// ErrNotFound, or ErrFenced.
func (s *Store) checkFenced(ctx context.Context, ref Ref, done Status) error {
	var status, token string
	err := s.pool.QueryRow(ctx, s.q.state, ref.Task, ref.Key).Scan(&status, &token)
	if errors.Is(err, pgx.ErrNoRows) {
		return ErrNotFound
	}
	if err != nil {
		return fmt.Errorf("read record state: %w", err)
	}
	if Token(token) == ref.Token && Status(status) == done {
		return nil
	}
	return fmt.Errorf("%w (record is %s)", ErrFenced, status)
}

// fenced runs a fencing write that returns its count of changed rows, and
// explains a zero count (nil for a repeat of the same call).
func (s *Store) fenced(ctx context.Context, op string, ref Ref, done Status, sql string, args ...any) error {
	var n int64
	if err := s.pool.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
		return writeError(op, err)
	}
	if n == 0 {
		if err := s.checkFenced(ctx, ref, done); err != nil {
			return fmt.Errorf("%s: %w", op, err)
		}
	}
	return nil
}

// Fail releases the claim as failed, keeping errText (as StorableText), so
// that a later delivery may claim it again. The failure is counted.
func (s *Store) Fail(ctx context.Context, ref Ref, errText string) error {
	return s.fenced(ctx, "fail", ref, StatusFailed, s.q.fail, ref.Task, ref.Key, string(ref.Token), StorableText(errText))
}

// Skip records the claim ref, whose lease has lapsed, as skipped (abandoned
// by policy); counted. ErrFenced when ref is no longer the current claim or
// its lease has not lapsed (its owner claimed it again). The record's token
// changes: the old owner's late writes are fenced.
func (s *Store) Skip(ctx context.Context, ref Ref, reason string) error {
	return s.skip(ctx, ref, reason, true)
}

// Hold records the claim ref, whose lease has lapsed, as held for a person
// to resolve, keeping message (when not nil) to replay it; counted. As Skip,
// ErrFenced when ref is not current or its lease has not lapsed.
func (s *Store) Hold(ctx context.Context, ref Ref, message []byte, reason string) error {
	return s.hold(ctx, ref, message, reason, true)
}

// HoldOwn records the caller's own current claim ref as held, whatever its
// lease, keeping message (when not nil) to replay it: for a claimant that
// cannot record its outcome (the database refuses the result, the task
// was abandoned still running) and leaves the decision to a person.
// ErrFenced when ref is no longer the current claim.
func (s *Store) HoldOwn(ctx context.Context, ref Ref, message []byte, reason string) error {
	return s.hold(ctx, ref, message, reason, false)
}

// SkipOwn records the caller's own current claim ref as skipped, whatever
// its lease (see HoldOwn).
func (s *Store) SkipOwn(ctx context.Context, ref Ref, reason string) error {
	return s.skip(ctx, ref, reason, false)
}

// Rewritten is the final state of a claim that the record has lost (a
// write on it found no record: ErrNotFound), for Rewrite.
type Rewritten struct {
	// Status is StatusCompleted, StatusFailed, StatusHeld or StatusSkipped.
	Status Status
	// Result is a completion's JSON result (nil for none).
	Result []byte
	// Error is a failure's text; Reason a hold's or skip's.
	Error, Reason string
	// Message is a held operation's kept message (nil for none).
	Message []byte
}

// Rewrite writes the outcome st of the claim ref anew when the record has
// lost it altogether (Complete, Fail, HoldOwn or SkipOwn returned
// ErrNotFound: a failover to a server the claim never reached, or a record
// deleted): the record is inserted in its final state, as the write would
// have left it, and counted as that write is. When a record exists again
// (another delivery claimed the operation in between) nothing is written
// and the error is ErrFenced, as for a claim taken over; writing the same
// outcome again is a no-op. An error that may have committed is
// ErrUnknownOutcome; a refused result is ErrInvalidResult.
func (s *Store) Rewrite(ctx context.Context, ref Ref, st Rewritten) error {
	_, res, err := checkResult(st.Result)
	if err != nil {
		return fmt.Errorf("rewrite: %w", err)
	}
	token, kind := string(ref.Token), ""
	switch st.Status {
	case StatusCompleted:
	case StatusFailed:
		kind = "failure"
	case StatusHeld:
		token, kind = "settled:"+token, "held"
	case StatusSkipped:
		token, kind = "settled:"+token, "skipped"
	default:
		return fmt.Errorf("rewrite: status %q is not a final outcome", st.Status)
	}
	var errText, reason string
	if st.Error != "" {
		errText = StorableText(st.Error)
	}
	if st.Reason != "" {
		reason = StorableText(st.Reason)
	}
	var n int64
	if err := s.pool.QueryRow(ctx, s.q.rewrite, ref.Task, ref.Key, string(st.Status), token, res,
		errText, reason, st.Message, kind).Scan(&n); err != nil {
		return writeError("rewrite", err)
	}
	if n == 0 {
		if err := s.checkFenced(ctx, Ref{Task: ref.Task, Key: ref.Key, Token: Token(token)}, st.Status); err != nil {
			return fmt.Errorf("rewrite: %w", err)
		}
	}
	return nil
}

// Running reports whether a transaction now holds the record of (task,
// key) being written, and keeps it past a short wait: a same-database
// task's claim, which lives uncommitted in its transaction until the task
// commits. The probe writes in a transaction it always rolls back.
func (s *Store) Running(ctx context.Context, task, key string) (bool, error) {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return false, fmt.Errorf("running probe: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := tx.Exec(ctx, "SET LOCAL lock_timeout = '200ms'"); err != nil {
		return false, fmt.Errorf("running probe: %w", err)
	}
	_, err = tx.Exec(ctx, s.q.probe, task, key)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.SQLState() == "55P03" {
		return true, nil
	}
	if err != nil {
		return false, fmt.Errorf("running probe: %w", err)
	}
	return false, nil
}

// skip is Skip; lapsedOnly false settles the caller's own live claim (a
// takeover whose lookup failed).
func (s *Store) skip(ctx context.Context, ref Ref, reason string, lapsedOnly bool) error {
	return s.fenced(ctx, "skip", ref, StatusSkipped, s.q.skip, ref.Task, ref.Key, string(ref.Token), StorableText(reason), lapsedOnly)
}

// hold is Hold; lapsedOnly as for skip.
func (s *Store) hold(ctx context.Context, ref Ref, message []byte, reason string, lapsedOnly bool) error {
	return s.fenced(ctx, "hold", ref, StatusHeld, s.q.hold, ref.Task, ref.Key, string(ref.Token), message, StorableText(reason), lapsedOnly)
}

// Release makes the claim claimable again without counting a failure, for
// a task that asked to be retried later.
func (s *Store) Release(ctx context.Context, ref Ref) error {
	return s.execFenced(ctx, "release", ref, StatusFailed, s.q.release)
}

// execFenced runs sql, a write on the current claim ref ($1 task, $2 key,
// $3 token), and explains a write that changed no row (nil when the record
// already is in state done with ref's token: a repeated call).
func (s *Store) execFenced(ctx context.Context, op string, ref Ref, done Status, sql string) error {
	tag, err := s.pool.Exec(ctx, sql, ref.Task, ref.Key, string(ref.Token))
	if err != nil {
		return writeError(op, err)
	}
	if tag.RowsAffected() == 0 {
		if err := s.checkFenced(ctx, ref, done); err != nil {
			return fmt.Errorf("%s: %w", op, err)
		}
	}
	return nil
}

// Lapse ends the lease of the current claim ref now, leaving it claimed:
// the next Claim of the operation finds it stale (OutcomeStale), so the
// stale-claim policy decides, at once rather than when the lease would have
// run out. It is for a claimant that stops without knowing whether its
// effect happened (a task cut off by a shutdown): releasing the claim would
// let the next delivery run the effect again unasked. ErrFenced when ref is
// no longer the current claim.
func (s *Store) Lapse(ctx context.Context, ref Ref) error {
	return s.execFenced(ctx, "lapse", ref, StatusClaimed, s.q.lapse)
}

// Renew extends the lease of a current claim to now + lease. It fails with
// ErrFenced when the token is not current or the lease already lapsed. A
// claim the record has lost altogether (no record: a failover to a server
// the claim never reached, or a record deleted) is written anew, claimed
// with ref's token and the lease, and the claim goes on (logged); if
// another delivery has claimed the operation in between, ErrFenced.
func (s *Store) Renew(ctx context.Context, ref Ref, lease time.Duration) error {
	tag, err := s.pool.Exec(ctx, s.q.renew, ref.Task, ref.Key, string(ref.Token), lease.Microseconds())
	if err != nil {
		return fmt.Errorf("renew: %w", err)
	}
	if tag.RowsAffected() == 0 {
		if ref.Token == "" { // no claim of its own to write anew
			return fmt.Errorf("renew: %w", ErrFenced)
		}
		tag, err = s.pool.Exec(ctx, s.q.reclaim, ref.Task, ref.Key, string(ref.Token), lease.Microseconds())
		if err != nil {
			return fmt.Errorf("renew: write the lost claim anew: %w", err)
		}
		if tag.RowsAffected() == 0 {
			return fmt.Errorf("renew: %w", ErrFenced)
		}
		s.log.Warn("the record had lost this claim (as after an asynchronous failover, or a record deleted); written anew",
			zap.String("task", ref.Task))
	}
	return nil
}

// Keep renews the lease of ref every lease/3 while the task runs, and
// returns a context for the task. When the lease cannot be renewed before
// it lapses (counted from the call to Keep, less a tenth of the lease for
// the time the claim took, so call it right after the claim), or the claim
// is fenced, the context is cancelled with cause
// ErrLeaseLost (see context.Cause) and the task must not complete. The
// returned stop function ends the heartbeat, waits for it, and cancels the
// context; call it before Complete or Fail (with the caller's context).
//
// Most tasks end before their first renewal is due, so the heartbeat
// goroutine starts only then (a timer until the first renewal).
func (s *Store) Keep(ctx context.Context, ref Ref, lease time.Duration) (context.Context, func()) {
	return s.KeepSince(ctx, ref, lease, time.Now())
}

// KeepSince is Keep for a lease that began no earlier than since (by this
// process's clock; Claim.Since): the heartbeat and the deadline count from
// since, so the time the claim took, a policy's lookup included, is not
// added to the lease. A caller that finds the first renewal due before
// the task starts renews first (Renew) and refuses to run if that fails.
func (s *Store) KeepSince(ctx context.Context, ref Ref, lease time.Duration, since time.Time) (context.Context, func()) {
	kctx, cancel := context.WithCancelCause(ctx)
	stop := s.KeepOn(kctx, cancel, ref, lease, since)
	return kctx, func() {
		stop()
		cancel(context.Canceled)
	}
}

// KeepOn is KeepSince on a context the caller made for the task: cancel
// cancels ctx, which the heartbeat does with cause ErrLeaseLost when the
// lease is lost. The returned stop function ends the heartbeat and waits
// for it, and leaves ctx as it is; call it before Complete or Fail, then
// cancel ctx.
func (s *Store) KeepOn(ctx context.Context, cancel context.CancelCauseFunc, ref Ref, lease time.Duration, since time.Time) (stop func()) {
	if lease <= 0 {
		lease = time.Minute
	}
	h := &heartbeat{}
	h.started.Add(1)
	h.first = time.AfterFunc(max(time.Until(since.Add(lease/3)), 0), func() {
		defer h.started.Done()
		h.mu.Lock()
		if h.stopped {
			h.mu.Unlock()
			return
		}
		h.stop = make(chan struct{})
		h.mu.Unlock()
		s.keep(ctx, cancel, h.stop, ref, lease, since)
	})
	return h.end
}

// heartbeat is one KeepOn's: a timer until the first renewal, then keep on
// its timer's goroutine. Its stop channel is made only then: most tasks end
// before.
type heartbeat struct {
	first   *time.Timer
	started sync.WaitGroup // done when the timer's function returns
	mu      sync.Mutex
	stopped bool
	stop    chan struct{} // nil until the heartbeat starts
	once    sync.Once
}

// end stops the heartbeat and waits for it; it may be called more than once.
func (h *heartbeat) end() { h.once.Do(h.stopAndWait) }

func (h *heartbeat) stopAndWait() {
	h.mu.Lock()
	h.stopped = true
	if h.stop != nil {
		close(h.stop)
	}
	h.mu.Unlock()
	if !h.first.Stop() {
		h.started.Wait() // the timer fired: wait for the heartbeat
	}
}

// keep is the heartbeat, started when the first renewal is due.
func (s *Store) keep(ctx context.Context, cancel context.CancelCauseFunc, stop <-chan struct{}, ref Ref, lease time.Duration, began time.Time) {
	// The lease began at the claim, no earlier than began: stop a tenth of
	// the lease early rather than run past the database's lease.
	margin := lease / 10
	deadline := began.Add(lease - margin)
	interval := lease / 3
	select {
	case <-stop:
		return
	case <-ctx.Done():
		return
	default:
	}
	t := time.NewTimer(0) // the first renewal is due now
	defer t.Stop()
	// tick waits for the timer; false when stopped or ctx is done.
	tick := func() bool {
		select {
		case <-stop:
			return false
		case <-ctx.Done():
			return false
		case <-t.C:
			return true
		}
	}
	for {
		if !tick() {
			return
		}
		for {
			start := time.Now()
			rctx, rcancel := context.WithDeadline(ctx, deadline)
			err := s.Renew(rctx, ref, lease)
			rcancel()
			if err == nil {
				deadline = start.Add(lease - margin)
				break
			}
			if errors.Is(err, ErrFenced) || !time.Now().Before(deadline) || ctx.Err() != nil {
				s.log.Warn("idempotency lease lost", zap.String("task", ref.Task), zap.Error(err))
				cancel(fmt.Errorf("%w: %w", ErrLeaseLost, err))
				return
			}
			s.log.Info("idempotency lease renewal failed, retrying", zap.String("task", ref.Task), zap.Error(err))
			wait := min(interval/4, time.Until(deadline))
			t.Reset(max(wait, time.Millisecond))
			if !tick() {
				return
			}
		}
		t.Reset(interval)
	}
}

// RunTx runs a same-database task: the claim, fn's effect (through tx) and
// the completion commit in one transaction, so no lease is needed. A
// concurrent duplicate blocks on the record's unique key and then sees
// OutcomeCompleted. When the claim finds anything but a claimable record,
// fn does not run and that outcome is returned (a duplicate is counted).
// An error from fn rolls everything back (no record, no effect) and is
// returned. On success the Claim has OutcomeFirst, StatusCompleted and the
// result as the record keeps it (StorableJSON). A commit that may have
// succeeded is ErrUnknownOutcome.
//
// A failure caused by fn's own work is a *TaskTxError: fn returned nil
// with the transaction failed (it caught the error of one of its
// statements), fn ended the transaction itself, or the commit was refused
// for fn's data (a deferred constraint or constraint trigger). fn must
// neither commit nor roll back tx.
func (s *Store) RunTx(ctx context.Context, p ClaimParams, fn func(ctx context.Context, tx pgx.Tx) ([]byte, error)) (Claim, error) {
	if err := p.validate(); err != nil {
		return Claim{}, err
	}
	ctx = withoutDeferral(ctx)
	if s.txg != nil {
		return s.txg.run(ctx, p, fn)
	}
	return s.runSolo(ctx, p, fn)
}

// runSolo is RunTx in a transaction of its own.
func (s *Store) runSolo(ctx context.Context, p ClaimParams, fn func(ctx context.Context, tx pgx.Tx) ([]byte, error)) (Claim, error) {
	return s.runSoloTx(ctx, p, fn, nil)
}

// runSoloTx is runSolo; committing, when not nil, is called just before
// the commit (the transaction takes no more locks), or as it returns.
func (s *Store) runSoloTx(ctx context.Context, p ClaimParams, fn func(ctx context.Context, tx pgx.Tx) ([]byte, error), committing func()) (Claim, error) {
	if committing == nil {
		committing = func() {}
	}
	defer committing()
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return Claim{}, fmt.Errorf("run tx: begin: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	// Errors before the commit are definite: nothing was committed.
	row, err := s.claimRowWith(ctx, tx, s.q.claimOneTx, p.inTx(), false)
	if err != nil {
		return Claim{}, fmt.Errorf("run tx: claim: %w", err)
	}
	c := row.claim(p.Token)
	if c.Outcome != OutcomeFirst {
		committing()
		if err := tx.Commit(ctx); err != nil { // keeps the duplicate count
			return c, writeError("run tx: commit", err)
		}
		return c, nil
	}
	result, err := fn(ctx, tx)
	if endedTx(tx) {
		// Its connection goes back first: completing or holding may need
		// one of the pool's.
		_ = tx.Rollback(context.WithoutCancel(ctx))
		if err != nil {
			s.endedByTask(ctx, p.Ref(c.Token), p.heldMessage)
			return Claim{}, err
		}
		return s.completeEnded(ctx, p, c, result)
	}
	var stored []byte
	if err == nil {
		stored, err = s.completeInTx(ctx, tx, p, c, result)
	}
	if err != nil {
		err = s.soloRolledBack(ctx, tx, p, c, err)
		committing()
		return Claim{}, err
	}
	committing()
	if err := tx.Commit(ctx); err != nil {
		if refusedCommit(err) {
			// Refused for what the task wrote (a deferred constraint):
			// rolled back, the task's failure. (Had the task committed part
			// of the transaction itself, its claim is never taken for a
			// later run's own: inTxClaim.)
			return Claim{}, &TaskTxError{What: "commit refused", Err: err}
		}
		return Claim{}, writeError("run tx: commit", err)
	}
	c.Status, c.Result, c.LeaseUntil = StatusCompleted, stored, time.Time{}
	return c, nil
}

// completeInTx completes the claim c in tx, after the task's function
// returned result, and returns the result as the record keeps it.
func (s *Store) completeInTx(ctx context.Context, tx pgx.Tx, p ClaimParams, c Claim, result []byte) ([]byte, error) {
	if failedTx(tx) {
		return nil, &TaskTxError{What: "the task returned without an error, but one of its statements failed its transaction"}
	}
	stored, res, err := checkResult(result)
	if err != nil {
		return nil, fmt.Errorf("run tx: %w", err)
	}
	ok, err := s.completeRaw(ctx, tx, p.Ref(c.Token), res)
	if err != nil {
		return nil, fmt.Errorf("run tx: complete: %w", err)
	}
	if !ok {
		// Nobody else can see, let alone take, a claim uncommitted in this
		// transaction: the task ended it (a ROLLBACK AND CHAIN in a string
		// of statements), and nothing of it is left.
		return nil, &TaskTxError{What: "the task ended its transaction itself (its claim is gone from it)"}
	}
	return stored, nil
}

// completeEnded completes, outside any transaction, the claim c of a task
// that ended its transaction itself and returned result: if it committed,
// the claim and the effect are in the database and the completion records
// them; if it rolled back, there is nothing to complete and the task
// fails.
func (s *Store) completeEnded(ctx context.Context, p ClaimParams, c Claim, result []byte) (Claim, error) {
	s.log.Error("a same-database task ended its transaction itself; the worker commits it",
		zap.String("task", p.Task))
	stored, err := s.Complete(ctx, p.Ref(c.Token), result)
	switch {
	case err == nil:
		c.Status, c.Result, c.LeaseUntil = StatusCompleted, stored, time.Time{}
		return c, nil
	case errors.Is(err, ErrNotFound) || errors.Is(err, ErrFenced):
		return Claim{}, &TaskTxError{What: "the task ended its transaction itself (rolled back: nothing committed)"}
	default:
		return Claim{}, fmt.Errorf("run tx: complete after the task ended its transaction: %w", err)
	}
}

// endedByTask holds the claim ref of a task that ended its transaction
// itself and then failed: if the claim committed, the effect may have
// committed with it, and a person decides. The claim was written without
// the message (ClaimParams.inTx): the hold keeps message's, for the
// person to replay it.
func (s *Store) endedByTask(ctx context.Context, ref Ref, message func() []byte) {
	s.log.Error("a same-database task ended its transaction itself, then failed", zap.String("task", ref.Task))
	_ = s.holdEnded(ctx, ref, message, "the task ended its transaction itself, then failed: its effect may have committed")
}

// holdEnded holds the claim ref, written in a transaction that something
// other than the worker ended, for the reason why.
// It reports false when there was no claim of ref to hold: it did not
// commit.
func (s *Store) holdEnded(ctx context.Context, ref Ref, message func() []byte, why string) bool {
	err := s.hold(ctx, ref, message(), why, false)
	if err != nil && !errors.Is(err, ErrNotFound) && !errors.Is(err, ErrFenced) {
		s.log.Error("holding the claim of a task that ended its transaction failed; it lapses into its policy",
			zap.String("task", ref.Task), zap.Error(err))
	}
	return !errors.Is(err, ErrNotFound) && !errors.Is(err, ErrFenced)
}
