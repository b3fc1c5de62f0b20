package idempotency

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"
)

// A same-database task may commit part of its transaction itself and go on
// in a new one (COMMIT AND CHAIN, through tx.Conn() or a prepared
// statement), against RunTx's contract. The connection stays in a
// transaction, so nothing tells the worker at once; but the claims and
// effects before that point have committed, and a rollback no longer takes
// them. Wherever the worker rolls back a transaction in which functions
// ran, and would answer or run its operations again as if nothing had
// committed, it first asks the record: a claim of this very attempt (its
// token) found committed says that part did. Its effect may have
// committed with it, whole or in part, so the claim is held for a person
// and the task fails; an operation whose function had not run is released
// and runs again. The question follows the rollback on the transaction's
// own connection: it costs no connection and no wait for one. It is not
// asked when the connection was lost (a commit the task sent may still
// land), nor when it fails; nothing relies on it alone: RunTx's claims
// never take a claimed record for their own (inTxClaim), whatever its
// token, so a claim of the last attempt that committed, even late, is
// found in progress, then stale, by every later run. A group whose
// functions ran without savepoints also compares its transaction's id
// before it completes (finish): a function that ended the transaction and
// went on in a new one changed it.

// chainedClaimWhy is the reason a claim found committed after its
// transaction rolled back is held with.
const chainedClaimWhy = "its task committed part of its transaction itself (COMMIT AND CHAIN): its effect may have committed"

// rolledBackTimeout bounds the rollback and its question when the
// caller's context is what ended the run.
const rolledBackTimeout = 5 * time.Second

// rollBackAsking rolls tx back and then, on the same connection (no wait
// for one of the pool's), asks which of refs are current claims: claims
// that committed all the same. It reports none when the connection is gone
// or the question fails. The connection goes back to the pool.
func (s *Store) rollBackAsking(ctx context.Context, tx pgx.Tx, refs []Ref) map[opKey]bool {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rolledBackTimeout)
	defer cancel()
	defer func() { _ = tx.Rollback(ctx) }() // the connection back to the pool
	conn := tx.Conn()
	if conn.IsClosed() {
		return nil
	}
	// The rollback first, on its own: a statement the connection has not
	// prepared cannot be, in a failed transaction. AND CHAIN: the question
	// runs in a new transaction, which pgx's rollback then ends (a plain
	// ROLLBACK would leave it none to end, and the server would warn).
	if _, err := conn.Exec(ctx, "ROLLBACK AND CHAIN"); err != nil {
		return nil
	}
	tasks, keys, tokens := make(textArray, len(refs)), make(textArray, len(refs)), make(textArray, len(refs))
	for i, r := range refs {
		tasks[i], keys[i], tokens[i] = r.Task, r.Key, string(r.Token)
	}
	rows, err := conn.Query(ctx, s.q.ownClaims, s.batchArgs([]any{tasks, keys, tokens})...)
	if err == nil {
		var found map[opKey]bool
		if found, err = scanCompletedKeys(rows, len(refs)); err == nil {
			return found
		}
	}
	s.log.Warn("asking the record what of a rolled-back transaction committed failed", zap.Error(err))
	return nil
}

// soloRolledBack rolls back the transaction tx of a same-database task run
// on its own, whose function ran and which failed with err, and answers
// it: when its claim committed all the same, the claim is held and the
// task fails as the task's error.
func (s *Store) soloRolledBack(ctx context.Context, tx pgx.Tx, p ClaimParams, c Claim, err error) error {
	if len(s.rollBackAsking(ctx, tx, []Ref{p.Ref(c.Token)})) == 0 {
		return err
	}
	s.log.Error("a same-database task committed part of its transaction itself; its claim is held",
		zap.String("task", p.Task), zap.NamedError("failure", err))
	hctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rolledBackTimeout)
	defer cancel()
	s.holdEnded(hctx, p.Ref(c.Token), p.heldMessage, chainedClaimWhy)
	return &TaskTxError{What: "the task committed part of its transaction itself (COMMIT AND CHAIN), then failed; its claim is held", Err: err}
}

// chained rolls back the transaction tx of a group in which functions ran
// and, when part of it committed all the same, answers every member: one
// whose function ran and whose claim committed is held; one whose claim
// committed before its function ran is released and runs again on its
// own; the others run again on their own, or keep the answer they have.
// It reports false, answering none, when no claim of the group committed
// (or, no function having run, nothing could have: tx is left to its
// caller's rollback).
func (g *txGroup) chained(ctx context.Context, tx pgx.Tx, ms []*member) bool {
	if !slices.ContainsFunc(ms, func(m *member) bool { return m.invoked }) {
		return false
	}
	refs := make([]Ref, len(ms))
	for i, m := range ms {
		refs[i] = m.op.p.Ref(m.op.p.Token)
	}
	found := g.s.rollBackAsking(ctx, tx, refs)
	if len(found) == 0 {
		return false
	}
	g.s.log.Error("a function committed part of its transaction group's transaction itself; the claims that committed with it are held",
		zap.Int("members", len(ms)), zap.Int("committed", len(found)))
	for _, m := range ms {
		answered := m.done && !m.commit && m.err != nil
		m.done = true
		switch {
		case found[m.op.key()] && m.invoked:
			g.s.holdEnded(ctx, m.op.p.Ref(m.op.p.Token), m.op.p.heldMessage, chainedClaimWhy)
			m.commit, m.claim = false, Claim{}
			m.err = &TaskTxError{What: "a task of its transaction group committed part of the group's transaction itself (COMMIT AND CHAIN); its claim is held"}
		case found[m.op.key()]:
			g.rerunOwn(ctx, m)
		case answered:
		case m.commit && m.claim.Outcome != OutcomeFirst:
			m.commit = false // answered as found: the claim statement's answer
		default:
			m.commit = false
			m.op.newAttempt()
			m.claim, m.err = g.s.runSolo(m.op.ctx, m.op.p, m.op.fn)
		}
	}
	return true
}

// rerunOwn runs member m again in a transaction of its own when its claim
// may have committed without its function having run (its group's
// transaction was ended or committed in part by another member): the
// claim is released first, so that the run claims the operation afresh
// and, should it fail, a committed claim is never taken for its own.
func (g *txGroup) rerunOwn(ctx context.Context, m *member) {
	m.commit = false
	if err := g.s.Release(ctx, m.op.p.Ref(m.op.p.Token)); err != nil &&
		!errors.Is(err, ErrNotFound) && !errors.Is(err, ErrFenced) {
		// Unknown: its redelivery finds the claim (and, past its lease,
		// holds it).
		m.claim, m.err = Claim{}, fmt.Errorf("run tx: releasing a claim its group left: %w", err)
		return
	}
	m.op.newAttempt()
	m.claim, m.err = g.s.runSolo(m.op.ctx, m.op.p, m.op.fn)
}
