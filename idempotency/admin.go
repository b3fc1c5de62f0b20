package idempotency

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Record is one idempotency record, for people and the CLI.
type Record struct {
	Task, Key       string
	Status          Status
	Token           Token
	Owner, TaskID   string
	Attempt         int
	Fingerprint     []byte
	ClaimedAt       time.Time
	LeaseUntil      time.Time // zero when not claimed
	CompletedAt     time.Time // zero when not completed
	UpdatedAt       time.Time
	Result          []byte // JSON
	Error           string
	Reason          string // why it was skipped, held or resolved
	Duplicates      int
	LastDuplicateAt time.Time
	Message         []byte // kept to replay a held operation
}

func scanRecord(row pgx.Row) (Record, error) {
	var r Record
	var status, token string
	var attempt, dups int32
	var lease, completed, lastDup *time.Time
	err := row.Scan(&r.Task, &r.Key, &status, &token, &r.Owner, &r.TaskID, &attempt, &r.Fingerprint,
		&r.ClaimedAt, &lease, &completed, &r.UpdatedAt, &r.Result, &r.Error, &r.Reason, &dups,
		&lastDup, &r.Message)
	if err != nil {
		return Record{}, err
	}
	r.Status, r.Token, r.Attempt, r.Duplicates = Status(status), Token(token), int(attempt), int(dups)
	for _, p := range []struct {
		src *time.Time
		dst *time.Time
	}{{lease, &r.LeaseUntil}, {completed, &r.CompletedAt}, {lastDup, &r.LastDuplicateAt}} {
		if p.src != nil {
			*p.dst = *p.src
		}
	}
	return r, nil
}

// Get returns the record of (task, key), or ErrNotFound.
func (s *Store) Get(ctx context.Context, task, key string) (Record, error) {
	r, err := scanRecord(s.pool.QueryRow(ctx, s.q.get, task, key))
	if errors.Is(err, pgx.ErrNoRows) {
		return Record{}, ErrNotFound
	}
	if err != nil {
		return Record{}, fmt.Errorf("get record: %w", err)
	}
	return r, nil
}

// Filter selects records for List. Empty fields match everything.
type Filter struct {
	Task, Key string
	Status    Status
	// AfterTask and AfterKey page: records after this (task, key).
	AfterTask, AfterKey string
	// Limit is the most records returned. Default 100.
	Limit int
}

// List returns the records matching f, ordered by task and key.
func (s *Store) List(ctx context.Context, f Filter) ([]Record, error) {
	if f.Limit <= 0 {
		f.Limit = 100
	}
	rows, err := s.pool.Query(ctx, s.q.list, f.Task, f.Key, string(f.Status), f.AfterTask, f.AfterKey, f.Limit)
	if err != nil {
		return nil, fmt.Errorf("list records: %w", err)
	}
	defer rows.Close()
	var out []Record
	for rows.Next() {
		r, err := scanRecord(rows)
		if err != nil {
			return nil, fmt.Errorf("list records: %w", err)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list records: %w", err)
	}
	return out, nil
}

// notHeld explains why a resolve changed nothing.
func (s *Store) notHeld(ctx context.Context, task, key string) error {
	_, err := s.Get(ctx, task, key)
	if err != nil {
		return err
	}
	return ErrNotHeld
}

// ResolveCompleted marks a held record completed, with an optional JSON
// result: a person found that the operation happened.
func (s *Store) ResolveCompleted(ctx context.Context, task, key string, result []byte) error {
	res, err := checkResult(result)
	if err != nil {
		return fmt.Errorf("resolve completed: %w", err)
	}
	tag, err := s.pool.Exec(ctx, s.q.resolveCompleted, task, key, res)
	if err != nil {
		return writeError("resolve completed", err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("resolve completed: %w", s.notHeld(ctx, task, key))
	}
	return nil
}

// ResolveRetry releases a held record for a new run (it becomes failed,
// so the next delivery claims it) and returns the stored message for the
// caller to republish (nil when none was kept).
func (s *Store) ResolveRetry(ctx context.Context, task, key string) ([]byte, error) {
	var msg []byte
	err := s.pool.QueryRow(ctx, s.q.resolveRetry, task, key).Scan(&msg)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("resolve retry: %w", s.notHeld(ctx, task, key))
	}
	if err != nil {
		return nil, writeError("resolve retry", err)
	}
	return msg, nil
}

// RepeatStats counts, for one task over a time range, what the record
// caught or let through.
type RepeatStats struct {
	Task string
	// Duplicates is deliveries that found the operation completed or in
	// progress: suppressed duplicates.
	Duplicates int64
	// Takeovers is stale claims taken over (policy retry or lookup).
	Takeovers int64
	// Held and Skipped count stale claims held for a person or skipped.
	Held, Skipped int64
	// Mismatches is deliveries whose arguments differed from the record's.
	Mismatches int64
	// Failures is runs that failed.
	Failures int64
}

// Repeats reports per task what happened from since until now.
func (s *Store) Repeats(ctx context.Context, since time.Time) ([]RepeatStats, error) {
	rows, err := s.pool.Query(ctx, s.q.repeats, since)
	if err != nil {
		return nil, fmt.Errorf("repeats: %w", err)
	}
	defer rows.Close()
	var out []RepeatStats
	for rows.Next() {
		var r RepeatStats
		if err := rows.Scan(&r.Task, &r.Duplicates, &r.Takeovers, &r.Held, &r.Skipped, &r.Mismatches, &r.Failures); err != nil {
			return nil, fmt.Errorf("repeats: %w", err)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("repeats: %w", err)
	}
	return out, nil
}

// PurgeParams bounds a retention purge.
type PurgeParams struct {
	// Before: completed, failed and skipped records last changed before it,
	// and events before it, are deleted. Required.
	Before time.Time
	// BatchSize is the most rows deleted per statement. Default 1000.
	BatchSize int
	// MaxBatches stops after this many batches per table (0: until done).
	MaxBatches int
}

// PurgeResult says what a purge deleted.
type PurgeResult struct {
	Records, Events int64
	Batches         int
}

// Purge deletes old completed, failed and skipped records (never claimed or
// held ones) and old events, in batches of at most BatchSize rows, each its
// own short transaction.
func (s *Store) Purge(ctx context.Context, p PurgeParams) (PurgeResult, error) {
	var res PurgeResult
	if p.Before.IsZero() {
		return res, errors.New("idempotency: purge needs a Before time")
	}
	if p.BatchSize <= 0 {
		p.BatchSize = 1000
	}
	for _, t := range []struct {
		sql string
		n   *int64
	}{{s.q.purgeRecords, &res.Records}, {s.q.purgeEvents, &res.Events}} {
		for i := 0; p.MaxBatches == 0 || i < p.MaxBatches; i++ {
			tag, err := s.pool.Exec(ctx, t.sql, p.Before, p.BatchSize)
			if err != nil {
				return res, fmt.Errorf("purge: %w", err)
			}
			res.Batches++
			*t.n += tag.RowsAffected()
			if tag.RowsAffected() < int64(p.BatchSize) {
				break
			}
		}
	}
	return res, nil
}
