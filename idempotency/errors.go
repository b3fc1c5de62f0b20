package idempotency

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

var (
	// ErrFenced reports that the claim token is no longer the current one:
	// the claim was taken over, completed, failed or released, so the caller
	// must not act on it.
	ErrFenced = errors.New("idempotency: claim token is no longer current")
	// ErrNotFound reports that no record exists for the task and key.
	ErrNotFound = errors.New("idempotency: record not found")
	// ErrNotHeld reports that a record asked to be resolved is not held.
	ErrNotHeld = errors.New("idempotency: record is not held")
	// ErrLeaseLost is the cause of the context returned by Keep when the
	// lease could not be renewed before it lapsed.
	ErrLeaseLost = errors.New("idempotency: lease lost")
	// ErrUnknownOutcome reports that a write may or may not have committed
	// (the connection failed after the commit was sent, or the caller gave up
	// while the write was in flight). The caller must not ack the message.
	ErrUnknownOutcome = errors.New("idempotency: outcome unknown")
	// ErrClosed reports a call on a closed Store.
	ErrClosed = errors.New("idempotency: store closed")
	// ErrInvalidResult reports a result that is not valid JSON.
	ErrInvalidResult = errors.New("idempotency: result is not valid JSON")
)

// IsRetryable reports whether err is transient: a lost or refused
// connection, a serialization failure or deadlock, a server shutting down.
// The same call may succeed when tried again. An unknown outcome is not
// retryable in this sense (see IsUnknownOutcome).
func IsRetryable(err error) bool {
	if err == nil || errors.Is(err, ErrUnknownOutcome) {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.SQLState() {
		case "40001", "40P01", // serialization failure, deadlock
			"55P03",                   // lock not available
			"57P01", "57P02", "57P03", // admin/crash shutdown, cannot connect now
			"53300": // too many connections
			return true
		}
		return strings.HasPrefix(pgErr.SQLState(), "08") // connection exception
	}
	if pgconn.SafeToRetry(err) {
		return true
	}
	var connErr *pgconn.ConnectError
	return errors.As(err, &connErr)
}

// IsUnknownOutcome reports whether err means a write may have committed.
func IsUnknownOutcome(err error) bool { return errors.Is(err, ErrUnknownOutcome) }

// unknownError carries the underlying cause of an unknown outcome.
type unknownError struct{ err error }

func (e *unknownError) Error() string { return "idempotency: outcome unknown: " + e.err.Error() }
func (e *unknownError) Unwrap() []error {
	return []error{ErrUnknownOutcome, e.err}
}

// writeError classifies the error of a write that was sent to the server:
// a server error means the transaction rolled back, and a failure to
// connect or a context already done before sending means nothing was sent.
// Anything else may have committed. (pgconn.SafeToRetry alone is not
// trusted here: a connection lost while the request was being written can
// surface as a "conn closed" lock error that claims to be safe.)
func writeError(op string, err error) error {
	if err == nil {
		return nil
	}
	var pgErr *pgconn.PgError
	var connErr *pgconn.ConnectError
	if errors.As(err, &pgErr) || errors.As(err, &connErr) ||
		(pgconn.SafeToRetry(err) && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded))) {
		return fmt.Errorf("%s: %w", op, err)
	}
	return fmt.Errorf("%s: %w", op, &unknownError{err: err})
}
