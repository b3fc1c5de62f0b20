package tasks

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	"github.com/onceler/onceler/idempotency"
)

// dbFault reports whether a same-database task's error is a failure of the
// database connection rather than of the task: a lost or refused
// connection, a server shutting down or terminating the backend (SQLSTATE
// class 08, 57P01-57P03, any FATAL or PANIC error), a serialization failure
// or deadlock (idempotency.IsRetryable), an unknown outcome, or a network
// error. The task's own function may wrap the error. connClosed says
// whether the transaction's connection is closed after the task returned.
// An error caused by the end of a context (time limits, revocation,
// shutdown, the task's own deadline) is never a fault: pgx closes the
// connection under a cancelled query, which is the task's outcome.
func dbFault(err error, connClosed bool) bool {
	if err == nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) ||
		errors.Is(err, ErrSoftTimeLimit) || errors.Is(err, ErrTimeLimit) || errors.Is(err, ErrRevoked) ||
		errors.Is(err, ErrShutdown) || errors.Is(err, idempotency.ErrLeaseLost) {
		return false
	}
	if connClosed || idempotency.IsRetryable(err) || idempotency.IsUnknownOutcome(err) {
		return true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Severity == "FATAL" || pgErr.Severity == "PANIC"
	}
	var netErr net.Error
	return errors.As(err, &netErr) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed)
}

// countRedelivery counts a redelivered same-database message's attempt at
// its operation in a committed statement of its own (the operation's claim
// lives in its transaction, which a crash rolls back, so the record cannot
// count it) and quarantines the message as poison past Config.MaxAttempts.
// Only redeliveries its transport does not count are counted (a quorum
// queue counts them itself: x-delivery-count), each delivery once: a first
// delivery costs nothing. It returns false when it dealt with the delivery
// (quarantined, or kept for a later look when the database did not answer).
func (w *Worker) countRedelivery(ctx context.Context, j *job) bool {
	if !j.d.redelivered() || j.d.deliveryCount() > 0 {
		return true
	}
	if j.redeliveries == 0 {
		n, err := w.store.CountAttempt(ctx, j.h.name, j.key)
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "42P01" {
			// The record's schema predates the attempts table: run
			// uncounted rather than keep the delivery forever.
			w.log.Error("record schema not migrated (no attempts table): redelivery not counted; run '"+w.cfg.Program+" migrate'",
				w.fields(j, zap.Error(err))...)
			return true
		}
		if err != nil {
			w.recordTrouble(ctx, j, "count attempt", err)
			return false
		}
		j.redeliveries = n
	}
	if j.redeliveries <= w.cfg.MaxAttempts {
		return true
	}
	// A completed operation is answered from the record as usual.
	rec, err := w.store.Get(ctx, j.h.name, j.key)
	switch {
	case err == nil && rec.Status == idempotency.StatusCompleted:
		return true
	case err != nil && !errors.Is(err, idempotency.ErrNotFound):
		w.recordTrouble(ctx, j, "poison check", err)
		return false
	}
	// Not while the operation still runs: its claim is uncommitted in a
	// live transaction (the channel of the delivery running it was closed,
	// by the broker's consumer timeout say, and its copies came back): the
	// redeliveries wait for that run's outcome.
	switch running, err := w.store.Running(ctx, j.h.name, j.key); {
	case err != nil:
		w.recordTrouble(ctx, j, "poison check", err)
		return false
	case running:
		w.deferDelivery(j, time.Time{})
		return false
	}
	// The run the probe waited for may have just committed its outcome.
	switch rec, err := w.store.Get(ctx, j.h.name, j.key); {
	case err == nil && rec.Status == idempotency.StatusCompleted:
		return true
	case err != nil && !errors.Is(err, idempotency.ErrNotFound):
		w.recordTrouble(ctx, j, "poison check", err)
		return false
	}
	w.log.Error("redelivered message keeps failing to finish its operation: quarantined as poison",
		w.fields(j, zap.Int("redeliveries", j.redeliveries), zap.Int("max_attempts", w.cfg.MaxAttempts))...)
	w.quarantinePoison(ctx, j, fmt.Errorf("operation redelivered %d times without an outcome (limit %d)", j.redeliveries, w.cfg.MaxAttempts))
	return false
}

// IsConnectionError reports whether err (possibly wrapped by a task) is a
// failure of a PostgreSQL connection rather than an answer: a lost or
// refused connection, a server shutting down or terminating the backend, a
// serialization failure or deadlock, an unknown commit outcome, or a network
// error. Outside-system tasks that reach their system through PostgreSQL
// (or any pgx connection) can pass it to RetryPolicy.AutoRetry, so that a
// call whose outcome is unknown is retried under the same reference instead
// of failing the operation.
func IsConnectionError(err error) bool { return dbFault(err, false) }
