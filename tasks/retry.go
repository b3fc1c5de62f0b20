package tasks

import (
	"errors"
	"fmt"
	"math/rand/v2"

	"github.com/onceler/onceler/celeryproto"
)

// maxRetriesError is the failure of a task that asked for a retry when its
// retries were used up. The caller sees the retry's cause, or Celery's
// MaxRetriesExceededError when there is none.
type maxRetriesError struct {
	task, id             string
	argsRepr, kwargsRepr string
	retries              int
	cause                error
}

// Error implements error.
func (e *maxRetriesError) Error() string {
	if e.cause != nil {
		return fmt.Sprintf("max retries (%d) exceeded: %v", e.retries, e.cause)
	}
	return fmt.Sprintf("max retries (%d) exceeded", e.retries)
}

// Unwrap returns the retry's cause.
func (e *maxRetriesError) Unwrap() error { return e.cause }

// exception is the exception the caller sees, as Celery raises it.
func (e *maxRetriesError) exception() *celeryproto.Exception {
	if e.cause != nil {
		return exceptionFor(e.cause)
	}
	// celery/app/task.py: MaxRetriesExceededError("Can't retry {0}[{1}] args:{2} kwargs:{3}")
	return &celeryproto.Exception{Type: "MaxRetriesExceededError", Module: "celery.exceptions",
		Message: fmt.Sprintf("Can't retry %s[%s] args:%s kwargs:%s", e.task, e.id, e.argsRepr, e.kwargsRepr)}
}

// taskOutcome turns what a task returned into what the worker acts on: an error
// the task's RetryPolicy.AutoRetry accepts becomes a retry request, and a
// retry request past the task's MaxRetries becomes a failure. cause is the
// cause of the task's context (nil while it was not cancelled): a task cut
// short by a time limit, revocation, lease loss or shutdown is not retried
// automatically (a soft time limit is an ordinary error for this).
func taskOutcome(j *job, cause, err error) error {
	if err == nil {
		return nil
	}
	p := j.h.retry
	var rr *RetryRequest
	if !errors.As(err, &rr) {
		if p.AutoRetry == nil || (cause != nil && !errors.Is(cause, ErrSoftTimeLimit)) || !p.AutoRetry(err) {
			return err
		}
		rr = &RetryRequest{Countdown: p.delay(j.msg.Retries, rand.Int64N), Cause: err}
		err = rr
	}
	if limit := p.maxRetries(); j.msg.Retries >= limit {
		return &maxRetriesError{task: j.h.name, id: j.msg.ID, argsRepr: j.msg.ArgsRepr, kwargsRepr: j.msg.KwargsRepr,
			retries: max(limit, 0), cause: rr.Cause}
	}
	return err
}
