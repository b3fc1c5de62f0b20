package idempotency

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
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
	// Live: the record is claimed and its lease has not lapsed, by the
	// database's clock when it was read.
	Live bool
}

func scanRecord(row pgx.Row) (Record, error) {
	var r Record
	var status, token string
	var attempt, dups int32
	var lease, completed, lastDup *time.Time
	err := row.Scan(&r.Task, &r.Key, &status, &token, &r.Owner, &r.TaskID, &attempt, &r.Fingerprint,
		&r.ClaimedAt, &lease, &completed, &r.UpdatedAt, &r.Result, &r.Error, &r.Reason, &dups,
		&lastDup, &r.Message, &r.Live)
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
	// Stale selects only claims whose lease has lapsed (by the database's
	// clock): operations whose claimant stopped without an outcome, which
	// the stale-claim policy settles at their next delivery.
	Stale bool
	// Limit is the most records returned. Default 100.
	Limit int
}

// List returns the records matching f, ordered by task and key.
func (s *Store) List(ctx context.Context, f Filter) ([]Record, error) {
	if f.Limit <= 0 {
		f.Limit = 100
	}
	rows, err := s.pool.Query(ctx, s.q.list, f.Task, f.Key, string(f.Status), f.AfterTask, f.AfterKey, f.Limit, f.Stale)
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

// StaleClaims counts the claims whose lease has lapsed (see Filter.Stale).
func (s *Store) StaleClaims(ctx context.Context) (int64, error) {
	var n int64
	if err := s.pool.QueryRow(ctx, s.q.staleClaims).Scan(&n); err != nil {
		return 0, fmt.Errorf("count stale claims: %w", err)
	}
	return n, nil
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
	_, res, err := checkResult(result)
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
	// DryRun deletes nothing: the result counts what a purge with these
	// parameters would delete now (Batches stays 0).
	DryRun bool
	// Progress, if set, is called after each batch that deleted rows, with
	// the totals so far (Counts left out). It runs on the calling goroutine.
	Progress func(sofar PurgeResult)
}

// PurgeResult says what a purge deleted, or a dry run would delete.
type PurgeResult struct {
	Records, Events int64
	// Batches is the number of delete statements run.
	Batches int
	// Counts breaks Records down by task and status, ordered by task then
	// status.
	Counts []PurgeCount
}

// PurgeCount is how many records of one task and status a purge deleted.
type PurgeCount struct {
	Task    string
	Status  Status
	Records int64
}

// Purge deletes old completed, failed and skipped records (never claimed or
// held ones) and old events, in batches of at most BatchSize rows, each its
// own short transaction, and attempt counts (CountAttempt) not updated since
// Before. With DryRun it only counts records and events.
func (s *Store) Purge(ctx context.Context, p PurgeParams) (res PurgeResult, err error) {
	if p.Before.IsZero() {
		return res, errors.New("idempotency: purge needs a Before time")
	}
	if p.BatchSize <= 0 {
		p.BatchSize = 1000
	}
	if p.DryRun {
		return s.purgeCount(ctx, p)
	}
	counts := map[purgeKey]int64{}
	defer func() { res.Counts = sortCounts(counts) }() // also on error: what was deleted
	progress := func() {
		if p.Progress != nil {
			p.Progress(PurgeResult{Records: res.Records, Events: res.Events, Batches: res.Batches})
		}
	}
	for i := 0; p.MaxBatches == 0 || i < p.MaxBatches; i++ {
		n, err := s.purgeRecordBatch(ctx, p, counts)
		if err != nil {
			return res, err
		}
		res.Batches++
		res.Records += n
		if n > 0 {
			progress()
		}
		if n < int64(p.BatchSize) {
			break
		}
	}
	for i := 0; p.MaxBatches == 0 || i < p.MaxBatches; i++ {
		tag, err := s.pool.Exec(ctx, s.q.purgeEvents, p.Before, p.BatchSize)
		if err != nil {
			return res, fmt.Errorf("purge events: %w", err)
		}
		res.Batches++
		res.Events += tag.RowsAffected()
		if tag.RowsAffected() > 0 {
			progress()
		}
		if tag.RowsAffected() < int64(p.BatchSize) {
			break
		}
	}
	// Attempt counts (CountAttempt) are few: one statement.
	if _, err := s.pool.Exec(ctx, `DELETE FROM `+s.schema+`.attempts WHERE updated_at < $1`, p.Before); err != nil {
		return res, fmt.Errorf("purge attempt counts: %w", err)
	}
	return res, nil
}

type purgeKey struct {
	task   string
	status Status
}

// purgeRecordBatch deletes one batch of records, adds them to counts and
// returns how many it deleted.
func (s *Store) purgeRecordBatch(ctx context.Context, p PurgeParams, counts map[purgeKey]int64) (int64, error) {
	var total int64
	err := s.scanPurgeCounts(ctx, s.q.purgeRecords, func(k purgeKey, n int64) {
		counts[k] += n
		total += n
	}, p.Before, p.BatchSize)
	if err != nil {
		return total, fmt.Errorf("purge records: %w", err)
	}
	return total, nil
}

// purgeCount counts what Purge would delete with p.
func (s *Store) purgeCount(ctx context.Context, p PurgeParams) (PurgeResult, error) {
	var res PurgeResult
	var limit *int64 // NULL: no limit
	if p.MaxBatches > 0 {
		l := int64(p.MaxBatches) * int64(p.BatchSize)
		limit = &l
	}
	counts := map[purgeKey]int64{}
	err := s.scanPurgeCounts(ctx, s.q.countPurgeRecords, func(k purgeKey, n int64) {
		counts[k] += n
		res.Records += n
	}, p.Before, limit)
	if err != nil {
		return res, fmt.Errorf("purge dry run: %w", err)
	}
	res.Counts = sortCounts(counts)
	if err := s.pool.QueryRow(ctx, s.q.countPurgeEvents, p.Before, limit).Scan(&res.Events); err != nil {
		return res, fmt.Errorf("purge dry run: count events: %w", err)
	}
	return res, nil
}

// scanPurgeCounts runs a query that returns (task, status, count) rows.
func (s *Store) scanPurgeCounts(ctx context.Context, sql string, add func(purgeKey, int64), args ...any) error {
	rows, err := s.pool.Query(ctx, sql, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		var k purgeKey
		var n int64
		if err := rows.Scan(&k.task, &k.status, &n); err != nil {
			return err
		}
		add(k, n)
	}
	return rows.Err()
}

func sortCounts(m map[purgeKey]int64) []PurgeCount {
	out := make([]PurgeCount, 0, len(m))
	for k, n := range m {
		out = append(out, PurgeCount{Task: k.task, Status: k.status, Records: n})
	}
	slices.SortFunc(out, func(a, b PurgeCount) int {
		return cmp.Or(cmp.Compare(a.Task, b.Task), cmp.Compare(a.Status, b.Status))
	})
	return out
}
