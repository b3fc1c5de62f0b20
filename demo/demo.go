// Package demo holds onceler's demonstration tasks and the tables that stand
// in for the systems they touch. The onceler binary serves them ("onceler
// worker"; "onceler migrate" creates their tables); the tests, the replay
// suite and the benchmark use them too, and count the effects with the Count
// functions.
//
// The tasks, by Celery name:
//
//   - demo.add(x, y): x + y as Python adds: exact integers, a float when
//     either is one (3.0 stays a float). Pure: no record, every delivery
//     runs it.
//   - demo.ledger.credit(account, entry_id, cents): same-database. Inserts a
//     row into onceler_demo.ledger and adds cents to the account's row of
//     onceler_demo.balances, in one statement in the record's own
//     transaction; key entry_id. Returns {"entry_id", "account", "balance"}.
//   - demo.payments.charge(order_id, cents): an outside payment gateway that
//     de-duplicates by reference ("charge:<order_id>"). Every call is a row in
//     onceler_demo.gateway_calls; a charge is a row in
//     onceler_demo.gateway_charges only when none has that reference. Key
//     order_id; stale-claim policy lookup (looks the reference up). Returns
//     {"order_id", "charge_id"}.
//   - demo.email.send(message_id, to, subject): an outside mail service with no
//     reference and no lookup: a row per send in onceler_demo.email_sends. Key
//     message_id; policy hold. Returns {"message_id", "sent"}.
//   - demo.sleep(op, seconds): same-database; sleeps, then inserts a row into
//     onceler_demo.sleeps. Key op. For shutdown and crash tests.
//   - demo.flaky(op, failures): asks for a Celery retry (countdown 1 s) while
//     its retry count is below failures, then returns {"op", "attempts"}. Key
//     op; no outside effect, so its stale-claim policy is retry.
//   - demo.fail(message): always fails with Python ValueError(message).
//   - demo.xsum(numbers): the sum of a list of numbers. Pure; the body of a
//     chord of demo.add parts, which gets their results as its list.
//
// The simulated outside systems write in their own transactions, never in the
// record's, and every call to them is logged.
package demo

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/big"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"

	"github.com/onceler/onceler/tasks"
)

// Schema is the PostgreSQL schema of the demo tables.
const Schema = "onceler_demo"

// Task names.
const (
	TaskAdd    = "demo.add"
	TaskCredit = "demo.ledger.credit"
	TaskCharge = "demo.payments.charge"
	TaskEmail  = "demo.email.send"
	TaskSleep  = "demo.sleep"
	TaskFlaky  = "demo.flaky"
	TaskFail   = "demo.fail"
	TaskXsum   = "demo.xsum"
)

// Names lists every demo task name.
func Names() []string {
	return []string{TaskAdd, TaskCredit, TaskCharge, TaskEmail, TaskSleep, TaskFlaky, TaskFail, TaskXsum}
}

// Option configures Register.
type Option func(*options)

type options struct {
	logger *zap.Logger
}

// WithLogger sets the logger that records every call to a simulated outside
// system. The default logs nothing.
func WithLogger(l *zap.Logger) Option {
	return func(o *options) {
		if l != nil {
			o.logger = l
		}
	}
}

// AddArgs are the arguments of demo.add: numbers as the message gives
// them, integers (int64) or floats (float64); a bool counts as 0 or 1, as
// in Python.
type AddArgs struct {
	X any `celery:"x"`
	Y any `celery:"y"`
}

// CreditArgs are the arguments of demo.ledger.credit.
type CreditArgs struct {
	Account string `celery:"account"`
	EntryID string `celery:"entry_id"`
	Cents   int64  `celery:"cents"`
}

// ChargeArgs are the arguments of demo.payments.charge.
type ChargeArgs struct {
	OrderID string `celery:"order_id"`
	Cents   int64  `celery:"cents"`
}

// EmailArgs are the arguments of demo.email.send.
type EmailArgs struct {
	MessageID string `celery:"message_id"`
	To        string `celery:"to"`
	Subject   string `celery:"subject"`
}

// SleepArgs are the arguments of demo.sleep.
type SleepArgs struct {
	Op      string  `celery:"op"`
	Seconds float64 `celery:"seconds"`
}

// FlakyArgs are the arguments of demo.flaky.
type FlakyArgs struct {
	Op       string `celery:"op"`
	Failures int    `celery:"failures"`
}

// FailArgs are the arguments of demo.fail.
type FailArgs struct {
	Message string `celery:"message"`
}

// XsumArgs are the arguments of demo.xsum.
type XsumArgs struct {
	Numbers []float64 `celery:"numbers"`
}

// ChargeReference is the reference demo.payments.charge gives the gateway.
func ChargeReference(orderID string) string { return "charge:" + orderID }

// ErrEmptyKey is returned (wrapped) when an operation key argument is empty.
var ErrEmptyKey = errors.New("empty operation key")

func nonEmpty(what, v string) (string, error) {
	if v == "" {
		return "", fmt.Errorf("%s: %w", what, ErrEmptyKey)
	}
	return v, nil
}

// Register adds the demo tasks to reg. pool is the database of the demo
// tables (Migrate creates them); the tasks take the worker's default lease.
func Register(reg *tasks.Registry, pool *pgxpool.Pool, opts ...Option) error {
	o := options{logger: zap.NewNop()}
	for _, opt := range opts {
		opt(&o)
	}
	d := &demo{pool: pool, log: o.logger.Named("demo")}
	errs := []error{
		tasks.Register(reg, tasks.Task[AddArgs]{
			Name: TaskAdd,
			Mode: tasks.ModePure,
			Run:  d.add,
		}),
		tasks.Register(reg, tasks.Task[CreditArgs]{
			Name:    TaskCredit,
			Mode:    tasks.ModeSameDB,
			Key:     func(a CreditArgs) (string, error) { return nonEmpty("entry_id", a.EntryID) },
			RunStmt: d.credit,
		}),
		tasks.Register(reg, tasks.Task[ChargeArgs]{
			Name:     TaskCharge,
			Mode:     tasks.ModeOutside,
			Key:      func(a ChargeArgs) (string, error) { return nonEmpty("order_id", a.OrderID) },
			Policy:   tasks.PolicyLookup,
			Fallback: tasks.PolicyHold,
			Run:      d.charge,
			Lookup:   d.lookupCharge,
			// A gateway call cut off by a lost connection may or may not
			// have charged: call again with the same reference (the gateway
			// de-duplicates by it) rather than failing the order.
			Retry: tasks.RetryPolicy{MaxRetries: 5, Countdown: time.Second, AutoRetry: tasks.IsConnectionError},
		}),
		tasks.Register(reg, tasks.Task[EmailArgs]{
			Name:   TaskEmail,
			Mode:   tasks.ModeOutside,
			Key:    func(a EmailArgs) (string, error) { return nonEmpty("message_id", a.MessageID) },
			Policy: tasks.PolicyHold,
			Run:    d.email,
		}),
		tasks.Register(reg, tasks.Task[SleepArgs]{
			Name:  TaskSleep,
			Mode:  tasks.ModeSameDB,
			Key:   func(a SleepArgs) (string, error) { return nonEmpty("op", a.Op) },
			RunTx: d.sleep,
		}),
		tasks.Register(reg, tasks.Task[FlakyArgs]{
			Name:   TaskFlaky,
			Mode:   tasks.ModeOutside,
			Key:    func(a FlakyArgs) (string, error) { return nonEmpty("op", a.Op) },
			Policy: tasks.PolicyRetry,
			Run:    d.flaky,
		}),
		tasks.Register(reg, tasks.Task[FailArgs]{
			Name: TaskFail,
			Mode: tasks.ModePure,
			Run:  d.fail,
		}),
		tasks.Register(reg, tasks.Task[XsumArgs]{
			Name: TaskXsum,
			Mode: tasks.ModePure,
			Run:  d.xsum,
		}),
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("register demo tasks: %w", err)
	}
	return nil
}

type demo struct {
	pool *pgxpool.Pool
	log  *zap.Logger
}

// add answers as Python's x + y: two integers give their exact sum (an
// integer), a float makes it a float, which stays one on the wire (3.0,
// not 3).
func (d *demo) add(_ context.Context, _ *tasks.Call, a AddArgs) (any, error) {
	x, xInt := pyInt(a.X)
	y, yInt := pyInt(a.Y)
	if xInt && yInt {
		s := x + y
		if (s > x) == (y > 0) || y == 0 {
			return s, nil
		}
		// past int64: Python's integers have no bound
		return json.Number(new(big.Int).Add(big.NewInt(x), big.NewInt(y)).String()), nil
	}
	fx, okx := pyFloat(a.X)
	fy, oky := pyFloat(a.Y)
	if !okx || !oky {
		return nil, tasks.TypeError(fmt.Sprintf("unsupported operand type(s) for +: '%s' and '%s'", pyTypeName(a.X), pyTypeName(a.Y)))
	}
	return floatResult(fx + fy)
}

// pyInt reads an integer argument (a bool is 0 or 1).
func pyInt(v any) (int64, bool) {
	switch x := v.(type) {
	case int64:
		return x, true
	case int:
		return int64(x), true
	case int32:
		return int64(x), true
	case uint64:
		if x <= math.MaxInt64 {
			return int64(x), true
		}
	case bool:
		if x {
			return 1, true
		}
		return 0, true
	}
	return 0, false
}

// pyFloat reads a number argument as a float.
func pyFloat(v any) (float64, bool) {
	switch x := v.(type) {
	case float64:
		return x, true
	case float32:
		return float64(x), true
	case uint64:
		return float64(x), true
	}
	if i, ok := pyInt(v); ok {
		return float64(i), true
	}
	return 0, false
}

func pyTypeName(v any) string {
	switch v.(type) {
	case nil:
		return "NoneType"
	case string:
		return "str"
	case []any:
		return "list"
	case map[string]any:
		return "dict"
	case float64, float32:
		return "float"
	case bool:
		return "bool"
	}
	return "int"
}

// floatResult is f as a Python float on the wire: an integral value keeps
// its ".0" (JSON would make 3.0 the integer 3).
func floatResult(f float64) (any, error) {
	if math.IsInf(f, 0) || math.IsNaN(f) {
		return nil, tasks.PyError("OverflowError", "builtins", "float result out of range")
	}
	if f != math.Trunc(f) {
		return f, nil
	}
	if math.Abs(f) < 1e16 {
		return json.RawMessage(strconv.FormatFloat(f, 'f', -1, 64) + ".0"), nil
	}
	return json.RawMessage(strconv.FormatFloat(f, 'g', -1, 64)), nil
}

func (d *demo) xsum(_ context.Context, _ *tasks.Call, a XsumArgs) (any, error) {
	var sum float64
	for _, n := range a.Numbers {
		sum += n
	}
	return number(sum), nil
}

// number returns an integral float as an integer, so 2 + 3 answers 5, not 5.0.
func number(f float64) any {
	if f == float64(int64(f)) && f > -1e15 && f < 1e15 {
		return int64(f)
	}
	return f
}

// CreditResult is what demo.ledger.credit returns.
type CreditResult struct {
	EntryID string `json:"entry_id"`
	Account string `json:"account"`
	Balance int64  `json:"balance"`
}

// CreditSQL is demo.ledger.credit's statement: it enters a credit ($1 entry
// id, $2 account, $3 cents, $4 task id) and adds it to its account's
// balance, which it returns; the balance row keeps the cost of a credit
// from growing with the ledger.
const CreditSQL = `WITH entry AS (
	INSERT INTO onceler_demo.ledger (entry_id, account, cents, task_id) VALUES ($1, $2, $3, $4)
)
INSERT INTO onceler_demo.balances AS b (account, cents) VALUES ($2, $3)
ON CONFLICT (account) DO UPDATE SET cents = b.cents + excluded.cents
RETURNING b.cents`

// credit is one statement: under load, the credits of a transaction group
// go to the database together.
func (d *demo) credit(c *tasks.Call, a CreditArgs) (tasks.Stmt, error) {
	return tasks.Stmt{
		SQL:  CreditSQL,
		Args: []any{a.EntryID, a.Account, a.Cents, c.TaskID},
		Result: func(row pgx.Row) (any, error) {
			var balance int64
			if err := row.Scan(&balance); err != nil {
				return nil, fmt.Errorf("enter credit: %w", err)
			}
			d.log.Info("ledger entry written", zap.String("task_id", c.TaskID), zap.String("key", c.Key))
			return CreditResult{EntryID: a.EntryID, Account: a.Account, Balance: balance}, nil
		},
	}, nil
}

// ChargeResult is what demo.payments.charge returns.
type ChargeResult struct {
	OrderID  string `json:"order_id"`
	ChargeID string `json:"charge_id"`
}

// charge calls the simulated gateway: in the gateway's own transaction, it
// logs the call and creates the charge unless one with the reference exists.
func (d *demo) charge(ctx context.Context, c *tasks.Call, a ChargeArgs) (any, error) {
	ref := ChargeReference(a.OrderID)
	var created bool
	err := pgx.BeginFunc(ctx, d.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO onceler_demo.gateway_calls (reference, order_id, cents) VALUES ($1, $2, $3)`,
			ref, a.OrderID, a.Cents); err != nil {
			return fmt.Errorf("log gateway call: %w", err)
		}
		tag, err := tx.Exec(ctx, `INSERT INTO onceler_demo.gateway_charges (reference, order_id, cents) VALUES ($1, $2, $3)
			ON CONFLICT (reference) DO NOTHING`, ref, a.OrderID, a.Cents)
		if err != nil {
			return fmt.Errorf("create charge: %w", err)
		}
		created = tag.RowsAffected() == 1
		return nil
	})
	if err != nil {
		d.log.Warn("gateway call failed", zap.String("task_id", c.TaskID), zap.String("reference", ref), zap.Error(err))
		return nil, fmt.Errorf("payment gateway: %w", err)
	}
	d.log.Info("gateway called", zap.String("task_id", c.TaskID), zap.String("reference", ref), zap.Bool("charge_created", created))
	return ChargeResult{OrderID: a.OrderID, ChargeID: ref}, nil
}

// lookupCharge asks the simulated gateway whether a charge with the
// operation's reference exists.
func (d *demo) lookupCharge(ctx context.Context, c *tasks.Call, a ChargeArgs) (any, bool, error) {
	ref := ChargeReference(a.OrderID)
	var orderID string
	err := d.pool.QueryRow(ctx, `SELECT order_id FROM onceler_demo.gateway_charges WHERE reference = $1`, ref).Scan(&orderID)
	if errors.Is(err, pgx.ErrNoRows) {
		d.log.Info("gateway lookup", zap.String("task_id", c.TaskID), zap.String("reference", ref), zap.Bool("found", false))
		return nil, false, nil
	}
	if err != nil {
		d.log.Warn("gateway lookup failed", zap.String("task_id", c.TaskID), zap.String("reference", ref), zap.Error(err))
		return nil, false, fmt.Errorf("payment gateway lookup: %w", err)
	}
	d.log.Info("gateway lookup", zap.String("task_id", c.TaskID), zap.String("reference", ref), zap.Bool("found", true))
	return ChargeResult{OrderID: orderID, ChargeID: ref}, true, nil
}

// EmailResult is what demo.email.send returns.
type EmailResult struct {
	MessageID string `json:"message_id"`
	Sent      bool   `json:"sent"`
}

// email calls the simulated mail service, which keeps every send.
func (d *demo) email(ctx context.Context, c *tasks.Call, a EmailArgs) (any, error) {
	_, err := d.pool.Exec(ctx, `INSERT INTO onceler_demo.email_sends (message_id, to_addr, subject) VALUES ($1, $2, $3)`,
		a.MessageID, a.To, a.Subject)
	if err != nil {
		d.log.Warn("mail service call failed", zap.String("task_id", c.TaskID), zap.String("key", c.Key), zap.Error(err))
		return nil, fmt.Errorf("mail service: %w", err)
	}
	d.log.Info("email sent", zap.String("task_id", c.TaskID), zap.String("key", c.Key))
	return EmailResult{MessageID: a.MessageID, Sent: true}, nil
}

// SleepResult is what demo.sleep returns.
type SleepResult struct {
	Op    string  `json:"op"`
	Slept float64 `json:"slept"`
}

func (d *demo) sleep(ctx context.Context, tx pgx.Tx, c *tasks.Call, a SleepArgs) (any, error) {
	if a.Seconds < 0 {
		return nil, tasks.ValueError("seconds must not be negative")
	}
	d.log.Info("sleep started", zap.String("task_id", c.TaskID), zap.String("key", c.Key), zap.Float64("seconds", a.Seconds))
	t := time.NewTimer(time.Duration(a.Seconds * float64(time.Second)))
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
		return nil, fmt.Errorf("sleep interrupted: %w", context.Cause(ctx))
	}
	if _, err := tx.Exec(ctx, `INSERT INTO onceler_demo.sleeps (op, task_id) VALUES ($1, $2)`, a.Op, c.TaskID); err != nil {
		return nil, fmt.Errorf("insert sleep: %w", err)
	}
	d.log.Info("sleep done", zap.String("task_id", c.TaskID), zap.String("key", c.Key))
	return SleepResult{Op: a.Op, Slept: a.Seconds}, nil
}

// FlakyResult is what demo.flaky returns.
type FlakyResult struct {
	Op       string `json:"op"`
	Attempts int    `json:"attempts"`
}

// ErrFlaky is the cause of demo.flaky's retries.
var ErrFlaky = errors.New("flaky failure")

func (d *demo) flaky(_ context.Context, c *tasks.Call, a FlakyArgs) (any, error) {
	if c.Retries < a.Failures {
		d.log.Info("flaky task fails on purpose", zap.String("task_id", c.TaskID), zap.Int("retries", c.Retries))
		return nil, c.Retry(time.Second, fmt.Errorf("%w %d of %d", ErrFlaky, c.Retries+1, a.Failures))
	}
	return FlakyResult{Op: a.Op, Attempts: c.Retries + 1}, nil
}

func (d *demo) fail(_ context.Context, _ *tasks.Call, a FailArgs) (any, error) {
	return nil, tasks.ValueError(a.Message)
}
