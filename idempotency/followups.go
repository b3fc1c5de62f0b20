package idempotency

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// Followups returns the ids of the workflow steps (the next chain step,
// link callbacks) already published for the completed operation (task,
// key), in the order they were recorded: a duplicate delivery of the
// operation publishes only the others. ErrNotFound when there is no record.
func (s *Store) Followups(ctx context.Context, task, key string) ([]string, error) {
	var ids []string
	err := s.pool.QueryRow(ctx, `SELECT followups FROM `+s.schema+`.records WHERE task = $1 AND key = $2`, task, key).Scan(&ids)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, ErrNotFound
	}
	if err != nil {
		return nil, fmt.Errorf("followups: %w", err)
	}
	return ids, nil
}

// AddFollowups records that the workflow steps with these ids were
// published for the completed operation (task, key). Ids already recorded
// are kept once. Call it after the publishes are confirmed: a crash in
// between publishes them again on the next delivery (same ids), never not
// at all. ErrNotFound when the operation has no completed record.
func (s *Store) AddFollowups(ctx context.Context, task, key string, ids []string) error {
	if len(ids) == 0 {
		return nil
	}
	tag, err := s.pool.Exec(ctx, `UPDATE `+s.schema+`.records
SET followups = followups || ARRAY(SELECT DISTINCT x FROM unnest($3::text[]) AS x WHERE x <> ALL (followups) ORDER BY x)
WHERE task = $1 AND key = $2 AND status = 'completed'`, task, key, ids)
	if err != nil {
		return writeError("add followups", err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("add followups: %w", ErrNotFound)
	}
	return nil
}
