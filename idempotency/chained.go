package idempotency

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

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
// and runs again. The question costs a statement on those paths only, and
// is not asked when the connection was lost (a commit the task sent may
// still land). Against such a late commit, every run again after a
// rollback claims with a new token (txOp.newAttempt; the next RunTx call
// of a caller brings a new one too): a claim of the last attempt is then
// found another's, in progress, never its own. A group whose functions
// ran without savepoints also compares its transaction's id before it
// completes (finish): a function that ended the transaction and went on in
// a new one changed it.

// chainedClaimWhy is the reason a claim found committed after its
// transaction rolled back is held with.
const chainedClaimWhy = "its task committed part of its transaction itself (COMMIT AND CHAIN): its effect may have committed"

// rolledBackTimeout bounds the question (and a hold) after a task's
// transaction rolled back because its caller gave up.
const rolledBackTimeout = 5 * time.Second

// committedClaims reports which of refs are current claims in the
// database: claims that committed.
func (s *Store) committedClaims(ctx context.Context, refs []Ref) (map[opKey]bool, error) {
	tasks, keys, tokens := make(textArray, len(refs)), make(textArray, len(refs)), make(textArray, len(refs))
	for i, r := range refs {
		tasks[i], keys[i], tokens[i] = r.Task, r.Key, string(r.Token)
	}
	rows, err := s.pool.Query(ctx, s.q.ownClaims, s.batchArgs([]any{tasks, keys, tokens})...)
	if err != nil {
		return nil, err
	}
	return scanCompletedKeys(rows, len(refs))
}

// soloRolledBack is the answer of a same-database task run in a
// transaction of its own whose function ran and which then rolled back
// (err: why). When its claim committed all the same, the claim is held and
// the task fails as the task's error.
func (s *Store) soloRolledBack(ctx context.Context, p ClaimParams, c Claim, err error) error {
	// The caller's context may be what ended the run: the question has
	// a bound of its own.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rolledBackTimeout)
	defer cancel()
	found, cerr := s.committedClaims(ctx, []Ref{p.Ref(c.Token)})
	switch {
	case cerr != nil:
		return fmt.Errorf("run tx: %w (and finding whether part of it committed: %w)", err, &unknownError{err: cerr})
	case len(found) == 0:
		return err
	}
	s.log.Error("a same-database task committed part of its transaction itself; its claim is held",
		zap.String("task", p.Task), zap.NamedError("failure", err))
	s.holdEnded(ctx, p.Ref(c.Token), p.heldMessage, chainedClaimWhy)
	return &TaskTxError{What: "the task committed part of its transaction itself (COMMIT AND CHAIN), then failed; its claim is held", Err: err}
}

// chained answers the members of a group whose transaction the worker
// rolled back (or lost) after functions ran in it, when part of it
// committed all the same: a member whose function ran and whose claim
// committed is held; one whose claim committed before its function ran is
// released and runs again on its own; the others run again on their own,
// or keep the answer they have. It reports false, answering none, when no
// function ran or no claim of the group committed.
func (g *txGroup) chained(ctx context.Context, ms []*member) bool {
	if !slices.ContainsFunc(ms, func(m *member) bool { return m.invoked }) {
		return false
	}
	refs := make([]Ref, len(ms))
	for i, m := range ms {
		refs[i] = m.op.p.Ref(m.op.p.Token)
	}
	found, err := g.s.committedClaims(ctx, refs)
	if err == nil && len(found) == 0 {
		return false
	}
	if err != nil {
		err = fmt.Errorf("run tx: finding what of the group's transaction committed: %w", &unknownError{err: err})
	} else {
		g.s.log.Error("a function committed part of its transaction group's transaction itself; the claims that committed with it are held",
			zap.Int("members", len(ms)), zap.Int("committed", len(found)))
	}
	for _, m := range ms {
		answered := m.done && !m.commit && m.err != nil
		m.done = true
		switch {
		case err != nil:
			if !answered {
				m.commit, m.claim, m.err = false, Claim{}, err
			}
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
