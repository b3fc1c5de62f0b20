package idempotency

import "context"

// WriteFlush writes one flush of the batcher, the claims of ps and the
// completions of refs (result {"ok":true}), through the statements a flush
// of that size uses, and returns how many claims it answered and how many
// records it completed. The store must be batched; the claims carry their
// tokens.
func WriteFlush(s *Store, ps []ClaimParams, refs []Ref) (int, error) {
	claims := make([]*claimOp, len(ps))
	for i, p := range ps {
		claims[i] = &claimOp{p: p}
	}
	res := `{"ok":true}`
	completes := make([]*completeOp, len(refs))
	for i, r := range refs {
		completes[i] = &completeOp{ref: r, result: &res}
	}
	rows, done, err := s.batch.write(claims, completes)
	return len(rows) + len(done), err
}

// Deferrable is deferrable: whether Defer takes a statement.
var Deferrable = deferrable

// PlainArgs is plainArgs: whether Defer takes a statement's arguments.
var PlainArgs = plainArgs

// DeferUnchecked is Defer without its check of the statement: what a group
// does when a deferred statement ends or changes its transaction all the
// same.
func DeferUnchecked(ctx context.Context, d Deferred) bool { return deferTo(ctx, d, false) }

// TxControl is txControl.
var TxControl = txControl
