package tasks

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"sort"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/control"
	"github.com/onceler/onceler/idempotency"
)

// Mode says where a task's side effect lands, and so how the record guards it.
type Mode int

const (
	// ModePure marks a task without side effects worth guarding: it runs
	// without a record, every delivery runs it.
	ModePure Mode = iota
	// ModeSameDB marks a task whose effect is written to the record's own
	// PostgreSQL database through the pgx.Tx handed to RunTx: claim, effect and
	// completion commit in one transaction.
	ModeSameDB
	// ModeOutside marks a task whose effect lands in an outside system. The
	// claim commits first; the task passes Call.Reference (the operation key)
	// to the outside system so that it can recognise a repeat.
	ModeOutside
)

// String returns the mode's name as used in logs and metrics.
func (m Mode) String() string {
	switch m {
	case ModePure:
		return "pure"
	case ModeSameDB:
		return "same_db"
	case ModeOutside:
		return "outside"
	default:
		return fmt.Sprintf("mode(%d)", int(m))
	}
}

// Policy decides what happens to an outside-mode operation whose claim went
// stale: its owner stopped renewing the lease (it died or hung) without
// recording an outcome, so nobody knows whether the effect happened. It is
// the record's own policy type (idempotency.Policy), which carries it out.
type Policy = idempotency.Policy

const (
	// PolicyHold records the operation as held, keeps the message for
	// replaying and waits for a person to resolve it. The default.
	PolicyHold = idempotency.PolicyHold
	// PolicyRetry takes the claim over and runs the task again: the effect may
	// happen twice (the rare duplicate, counted as a stale takeover).
	PolicyRetry = idempotency.PolicyRetry
	// PolicySkip records the operation as skipped and does not run it: the
	// effect may never happen (the rare miss, counted).
	PolicySkip = idempotency.PolicySkip
	// PolicyLookup takes the claim over and asks the outside system through
	// Task.Lookup whether the effect happened: found completes the operation
	// with the found result, not found runs the task, an error applies
	// Task.Fallback.
	PolicyLookup = idempotency.PolicyLookup
)

// RetryPolicy sets a task's Celery-style retries: those it asks for with
// Call.Retry (Celery's self.retry) and those AutoRetry starts for it
// (Celery's autoretry_for).
type RetryPolicy struct {
	// MaxRetries is the number of retries allowed; past it the task fails
	// with the retry's cause, or MaxRetriesExceededError when it has none.
	// 0 means Celery's default, 3; negative means no retries.
	MaxRetries int
	// Countdown is the delay of a retry when Call.Retry is given 0 and
	// Backoff is not set. Default 180 s, as Celery's default_retry_delay.
	Countdown time.Duration
	// Backoff, when set, makes the delay of retry n (n = the retries so far)
	// Backoff × 2^n, at most BackoffMax, as Celery's retry_backoff; with
	// jitter (the default, as Celery's retry_jitter) a uniformly random delay
	// between 0 and that. It applies to automatic retries and to
	// Call.Retry(0, ...).
	Backoff time.Duration
	// BackoffMax caps the backoff delay. Default 10 minutes (Celery's
	// retry_backoff_max).
	BackoffMax time.Duration
	// NoJitter turns the backoff jitter off.
	NoJitter bool
	// AutoRetry reports whether an error returned by the task asks for a
	// retry by itself, as Celery's autoretry_for: the task is retried with
	// the error as the cause (and the caller sees that error once the retries
	// are used up). Nil: no automatic retries. Time limits, revocation and
	// shutdown are never retried automatically.
	AutoRetry func(err error) bool
}

// delay is the countdown of the retry after retries retries.
func (p RetryPolicy) delay(retries int, rnd func(n int64) int64) time.Duration {
	if p.Backoff <= 0 {
		if p.Countdown > 0 {
			return p.Countdown
		}
		return defaultCountdown
	}
	ceiling := p.BackoffMax
	if ceiling <= 0 {
		ceiling = defaultBackoffMax
	}
	d := ceiling
	retries = max(retries, 0) // the decoder refuses a negative count; never a negative shift
	if retries < 62 && p.Backoff <= ceiling>>min(retries, 62) {
		d = p.Backoff << retries
	}
	if !p.NoJitter && d > 0 {
		d = time.Duration(rnd(int64(d) + 1))
	}
	return d
}

// maxRetries is MaxRetries with its default applied.
func (p RetryPolicy) maxRetries() int {
	if p.MaxRetries == 0 {
		return 3
	}
	return p.MaxRetries
}

const (
	defaultCountdown  = 180 * time.Second
	defaultBackoffMax = 10 * time.Minute
)

// Task declares one Celery task implemented in Go. A is the argument type: a
// struct whose exported fields bind the Celery args by position (declaration
// order) and the kwargs by name (`celery:"name"` tag, else the json tag name,
// else the field name in snake_case). A field is required unless it is a
// pointer or its tag carries the option "optional" (or json's "omitempty").
type Task[A any] struct {
	// Name is the stable Celery task name, e.g. "billing.charge".
	Name string
	// Mode says where the effect lands. Default ModePure.
	Mode Mode
	// Key derives the operation key from the arguments. Required for
	// ModeSameDB and ModeOutside. A producer's `idempotency_key` header wins
	// when present.
	Key func(A) (string, error)
	// Policy applies when an outside-mode claim is found stale. Default PolicyHold.
	Policy Policy
	// Fallback applies when Policy is PolicyLookup and Lookup fails. It must
	// not be PolicyLookup. Default PolicyHold.
	Fallback Policy
	// Lease is how long a claim stays valid without renewal; the worker
	// renews it while the task runs. 0 means the worker's Config.Lease.
	Lease time.Duration
	// Run is the task body for ModePure and ModeOutside. Its result must be
	// JSON-encodable; it is the Celery result.
	Run func(ctx context.Context, c *Call, args A) (any, error)
	// RunTx is the task body for ModeSameDB: write the effect through tx,
	// which also holds the claim and the completion.
	RunTx func(ctx context.Context, tx pgx.Tx, c *Call, args A) (any, error)
	// RunStmt is the task body for ModeSameDB when its effect is one SQL
	// statement, instead of RunTx: it returns the statement, which runs in
	// the transaction of the claim and the completion. Under load, same-
	// database tasks run in transaction groups (BatchConfig.GroupTx), and
	// there the statements of the group's RunStmt tasks go to the database
	// together, in one round trip, where RunTx functions each wait for
	// their own statements' answers (the group sends only statements that
	// cannot end its transaction; see Stmt). A task with a time limit runs
	// its statement as RunTx would, where the limit applies to it.
	RunStmt func(c *Call, args A) (Stmt, error)
	// LookupTimeout bounds one call of Lookup; a lookup that runs out of
	// time counts as failed (Fallback). It runs under the lease of the
	// takeover, so that the claim can be renewed after it: 0 and anything
	// longer mean half the lease.
	LookupTimeout time.Duration
	// Lookup asks the outside system whether the operation (Call.Reference)
	// already happened. Required with PolicyLookup.
	Lookup func(ctx context.Context, c *Call, args A) (result any, found bool, err error)
	// Retry bounds Celery-style retries.
	Retry RetryPolicy
	// TimeLimit is the hard time limit; SoftTimeLimit cancels the task's
	// context (cause ErrSoftTimeLimit). 0 means the message's timelimit, if any.
	TimeLimit, SoftTimeLimit time.Duration
	// RateLimit limits how often the task starts on this worker, in
	// Celery's syntax: "10/s", "10/m", "10/h" (a number alone is per
	// second); "" means no limit. Deliveries of the task wait, without a
	// task slot, until the limit lets them start, one at a time (Celery's
	// token bucket); other tasks are not held. The rate_limit remote
	// command changes it at run time.
	RateLimit string
	// AllowMismatch lets a delivery whose arguments differ from those recorded
	// for the same operation key be treated as a repeat of that operation,
	// rather than quarantined.
	AllowMismatch bool
}

// handler is a registered task with its argument type erased.
type handler struct {
	name          string
	mode          Mode
	policy        Policy
	fallback      Policy
	lease         time.Duration
	retry         RetryPolicy
	timeLimit     time.Duration
	softTimeLimit time.Duration
	rateLimit     float64 // per second; 0: none
	allowMismatch bool
	hasLookup     bool
	lookupTimeout time.Duration

	// bind turns Celery args and kwargs into the task's argument value.
	bind func(args []any, kwargs map[string]any) (any, error)
	// key derives the operation key from a bound argument value.
	key func(a any) (string, error)
	// run, runTx and lookup call the typed functions with a bound value.
	run   func(ctx context.Context, c *Call, a any) (any, error)
	runTx func(ctx context.Context, tx pgx.Tx, c *Call, a any) (any, error)
	// stmt is RunStmt's (runTx runs its statement on tx).
	stmt   func(c *Call, a any) (Stmt, error)
	lookup func(ctx context.Context, c *Call, a any) (any, bool, error)
	// fnPC is the entry of the task function (Run, RunTx or RunStmt): its frame in
	// a traceback (traceback.go) when nothing better is known; callPC the
	// worker's call of it (run or runTx), the traceback's first frame.
	fnPC, callPC uintptr
}

// Registry holds the tasks a worker serves, by Celery name. It is safe for
// concurrent use.
type Registry struct {
	mu    sync.RWMutex
	tasks map[string]*handler
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry {
	return &Registry{tasks: make(map[string]*handler)}
}

// ErrInvalidTask is returned (wrapped) by Register for a task declaration
// that cannot be served safely.
var ErrInvalidTask = errors.New("invalid task")

// ErrDuplicateTask is returned (wrapped) by Register when the name is taken.
var ErrDuplicateTask = errors.New("task already registered")

// Register adds a task to the registry. It refuses a task that touches the
// outside world or the database without an operation key, a same-database
// task without RunTx, a lookup policy without Lookup, an argument type that
// is not a struct, and a name already registered.
func Register[A any](r *Registry, t Task[A]) error {
	h, err := newHandler(t)
	if err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.tasks[t.Name]; ok {
		return fmt.Errorf("register %q: %w", t.Name, ErrDuplicateTask)
	}
	r.tasks[t.Name] = h
	return nil
}

func invalid(name, format string, a ...any) error {
	return fmt.Errorf("register %q: %w: %s", name, ErrInvalidTask, fmt.Sprintf(format, a...))
}

func newHandler[A any](t Task[A]) (*handler, error) {
	if t.Name == "" {
		return nil, invalid(t.Name, "empty task name")
	}
	b, err := newBinder(reflect.TypeFor[A]())
	if err != nil {
		return nil, invalid(t.Name, "%v", err)
	}
	if t.Mode != ModePure && len(t.Name) > idempotency.MaxTaskBytes {
		return nil, invalid(t.Name[:40]+"...", "name of %d bytes: the record keeps task names of at most %d", len(t.Name), idempotency.MaxTaskBytes)
	}
	switch t.Mode {
	case ModePure:
		if t.Run == nil {
			return nil, invalid(t.Name, "pure task without Run")
		}
	case ModeOutside:
		if t.Run == nil {
			return nil, invalid(t.Name, "outside task without Run")
		}
		if t.Key == nil {
			return nil, invalid(t.Name, "outside task without Key: an operation key is required, the task id is not one")
		}
	case ModeSameDB:
		if t.RunTx == nil && t.RunStmt == nil {
			return nil, invalid(t.Name, "same-database task without RunTx or RunStmt")
		}
		if t.RunTx != nil && t.RunStmt != nil {
			return nil, invalid(t.Name, "same-database task with both RunTx and RunStmt")
		}
		if t.Key == nil {
			return nil, invalid(t.Name, "same-database task without Key: an operation key is required, the task id is not one")
		}
	default:
		return nil, invalid(t.Name, "unknown mode %d", int(t.Mode))
	}
	if t.Mode != ModeSameDB && (t.RunTx != nil || t.RunStmt != nil) {
		return nil, invalid(t.Name, "RunTx and RunStmt are only for ModeSameDB")
	}
	if t.Policy < PolicyHold || t.Policy > PolicyLookup {
		return nil, invalid(t.Name, "unknown policy %d", int(t.Policy))
	}
	if t.Policy == PolicyLookup && t.Lookup == nil {
		return nil, invalid(t.Name, "policy lookup without Lookup")
	}
	if t.Fallback == PolicyLookup || t.Fallback < PolicyHold || t.Fallback > PolicyLookup {
		return nil, invalid(t.Name, "fallback policy must be hold, retry or skip")
	}
	if t.Lease < 0 || t.LookupTimeout < 0 || t.TimeLimit < 0 || t.SoftTimeLimit < 0 || t.Retry.Countdown < 0 || t.Retry.Backoff < 0 || t.Retry.BackoffMax < 0 {
		return nil, invalid(t.Name, "negative duration")
	}
	rate, err := control.ParseRate(t.RateLimit)
	if err != nil {
		return nil, invalid(t.Name, "RateLimit: %v", err)
	}
	h := &handler{
		rateLimit:     rate,
		name:          t.Name,
		mode:          t.Mode,
		policy:        t.Policy,
		fallback:      t.Fallback,
		lease:         t.Lease,
		retry:         t.Retry,
		timeLimit:     t.TimeLimit,
		softTimeLimit: t.SoftTimeLimit,
		allowMismatch: t.AllowMismatch,
		hasLookup:     t.Lookup != nil,
		lookupTimeout: t.LookupTimeout,
		bind: func(args []any, kwargs map[string]any) (any, error) {
			var a A
			if err := b.bind(reflect.ValueOf(&a).Elem(), args, kwargs); err != nil {
				return nil, err
			}
			return a, nil
		},
	}
	if t.Key != nil {
		h.key = func(a any) (string, error) { return t.Key(a.(A)) }
	}
	if t.Run != nil {
		h.fnPC = reflect.ValueOf(t.Run).Pointer()
		h.run = func(ctx context.Context, c *Call, a any) (any, error) { return t.Run(ctx, c, a.(A)) }
		h.callPC = reflect.ValueOf(h.run).Pointer()
	}
	if t.RunTx != nil {
		h.fnPC = reflect.ValueOf(t.RunTx).Pointer()
		h.runTx = func(ctx context.Context, tx pgx.Tx, c *Call, a any) (any, error) { return t.RunTx(ctx, tx, c, a.(A)) }
		h.callPC = reflect.ValueOf(h.runTx).Pointer()
	}
	if t.RunStmt != nil {
		h.fnPC = reflect.ValueOf(t.RunStmt).Pointer()
		h.stmt = func(c *Call, a any) (Stmt, error) { return t.RunStmt(c, a.(A)) }
		h.runTx = func(ctx context.Context, tx pgx.Tx, c *Call, a any) (any, error) {
			return h.runStmt(ctx, tx, c, a, false)
		}
		h.callPC = reflect.ValueOf(h.runTx).Pointer()
	}
	if t.Lookup != nil {
		h.lookup = func(ctx context.Context, c *Call, a any) (any, bool, error) { return t.Lookup(ctx, c, a.(A)) }
	}
	return h, nil
}

// lookup returns the handler registered under name.
func (r *Registry) get(name string) (*handler, bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	h, ok := r.tasks[name]
	return h, ok
}

// Names returns the registered task names, sorted.
func (r *Registry) Names() []string {
	r.mu.RLock()
	defer r.mu.RUnlock()
	names := make([]string, 0, len(r.tasks))
	for n := range r.tasks {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// encodeResult turns a task's return value into the JSON stored in the
// record and sent to the caller.
func encodeResult(v any) ([]byte, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("encode task result as JSON: %w", err)
	}
	return b, nil
}
