package tasks

import (
	"errors"
	"fmt"
	"time"

	"github.com/onceler/onceler/celeryproto"
)

// PythonError is a task failure reported to the Celery caller as an instance
// of a chosen Python exception class: AsyncResult.get() raises
// Module.Type(Message).
type PythonError struct {
	Type    string // exception class name, e.g. "ValueError"
	Module  string // module the client imports it from, e.g. "builtins"
	Message string
}

// Error implements error.
func (e *PythonError) Error() string {
	if e.Message == "" {
		return e.Type
	}
	return e.Type + ": " + e.Message
}

// PyError returns a task failure that the Python caller sees as the exception
// module.excType(message). An empty module means "builtins".
func PyError(excType, module, message string) error {
	if module == "" {
		module = "builtins"
	}
	return &PythonError{Type: excType, Module: module, Message: message}
}

// ValueError returns a task failure raised as ValueError in Python.
func ValueError(msg string) error { return PyError("ValueError", "builtins", msg) }

// KeyError returns a task failure raised as KeyError in Python.
func KeyError(msg string) error { return PyError("KeyError", "builtins", msg) }

// TypeError returns a task failure raised as TypeError in Python.
func TypeError(msg string) error { return PyError("TypeError", "builtins", msg) }

// exceptionFor maps a task error to the exception the caller sees: a
// PythonError anywhere in the chain as given, anything else as a generic
// builtins.Exception with the error text.
func exceptionFor(err error) *celeryproto.Exception {
	var me *maxRetriesError
	if errors.As(err, &me) {
		return me.exception()
	}
	if errors.Is(err, ErrTimeLimit) {
		return &celeryproto.Exception{Type: "TimeLimitExceeded", Module: "billiard.exceptions", Message: err.Error()}
	}
	var pe *PythonError
	if errors.As(err, &pe) {
		return &celeryproto.Exception{Type: pe.Type, Module: pe.Module, Message: pe.Message}
	}
	var ae *ArgumentError
	if errors.As(err, &ae) {
		return &celeryproto.Exception{Type: "TypeError", Module: "builtins", Message: ae.Error()}
	}
	if errors.Is(err, ErrSoftTimeLimit) {
		return &celeryproto.Exception{Type: "SoftTimeLimitExceeded", Module: "billiard.exceptions", Message: err.Error()}
	}
	return &celeryproto.Exception{Type: "Exception", Module: "builtins", Message: err.Error()}
}

var (
	// ErrSoftTimeLimit is the cause of a task context cancelled by its soft
	// time limit (context.Cause).
	ErrSoftTimeLimit = errors.New("soft time limit exceeded")
	// ErrRevoked is the cause of a task context cancelled by a revoke with
	// terminate.
	ErrRevoked = errors.New("task revoked")
	// ErrShutdown is the cause of a task context cancelled because the
	// worker's grace period ran out.
	ErrShutdown = errors.New("worker shutting down")
)

// PanicError is the failure of a task that panicked.
type PanicError struct {
	Value any
	Stack []byte
	pcs   []uintptr // the panicking goroutine's stack, from the frame that panicked
}

// Error implements error.
func (e *PanicError) Error() string { return fmt.Sprintf("task panicked: %v", e.Value) }

// RetryRequest is what Call.Retry returns: the task asks to run again later
// (Celery's self.retry). Return it from Run unchanged.
type RetryRequest struct {
	Countdown time.Duration
	Cause     error
}

// Error implements error.
func (r *RetryRequest) Error() string {
	if r.Cause == nil {
		return fmt.Sprintf("retry in %s", r.Countdown)
	}
	return fmt.Sprintf("retry in %s: %v", r.Countdown, r.Cause)
}

// Unwrap returns the cause.
func (r *RetryRequest) Unwrap() error { return r.Cause }

// IsRetry reports whether err asks for a Celery retry.
func IsRetry(err error) bool {
	var r *RetryRequest
	return errors.As(err, &r)
}

// errRevokedWaiting: the task was revoked while its delivery waited to run,
// and is not started.
var errRevokedWaiting = errors.New("revoked before it started")
