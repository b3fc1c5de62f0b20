package idempotency

import (
	"context"
)

// CountAttempt counts one more attempt at the operation (task, key) in a
// statement of its own, committed at once, and returns the number counted so
// far (1 for the first). It is for attempts whose claim cannot keep the
// count: a same-database claim lives in the operation's transaction, which a
// crash rolls back, so the record's Attempt never grows. The worker calls it
// only for redelivered messages, to quarantine a message that keeps crashing
// its workers; the count is kept apart from the record and never changes it.
// Purge deletes counts not updated since its Before time.
func (s *Store) CountAttempt(ctx context.Context, task, key string) (int, error) {
	var n int
	err := s.pool.QueryRow(ctx, `INSERT INTO `+s.schema+`.attempts AS a (task, key, attempts) VALUES ($1, $2, 1)
ON CONFLICT (task, key) DO UPDATE SET attempts = a.attempts + 1, updated_at = now()
RETURNING attempts`, task, key).Scan(&n)
	if err != nil {
		return 0, writeError("count attempt", err)
	}
	return n, nil
}
