package tasks

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// errTxAbandoned is returned by the transaction of a same-database task
// abandoned at its hard time limit: the transaction was rolled back.
var errTxAbandoned = fmt.Errorf("%w: the task was abandoned at its hard time limit and its transaction rolled back", pgx.ErrTxClosed)

// txGuard serializes a time-limited same-database task's use of its
// transaction with the worker, so that the worker can roll the transaction
// back at the hard time limit while the abandoned task's goroutine still
// runs: once abandoned, every call fails with errTxAbandoned without
// touching the connection. A call holds the guard until it is done with the
// connection: Exec and friends until they return, Query until its rows are
// closed (or Next returns false), SendBatch until the batch is closed.
type txGuard struct {
	sem       chan struct{} // one slot: held while a call uses the connection
	abandoned atomic.Bool
}

func newTxGuard() *txGuard { return &txGuard{sem: make(chan struct{}, 1)} }

func (g *txGuard) acquire() error {
	if g.abandoned.Load() {
		return errTxAbandoned
	}
	g.sem <- struct{}{}
	if g.abandoned.Load() {
		<-g.sem
		return errTxAbandoned
	}
	return nil
}

func (g *txGuard) release() { <-g.sem }

// abandon makes every later call fail and waits until the call in progress,
// if any, is done with the connection: after wait (its context is cancelled,
// so pgx normally aborts it at once) the connection's socket is closed under
// it, which ends the transaction on the server and makes the call return.
// It returns whether the socket had to be closed.
func (g *txGuard) abandon(tx pgx.Tx, wait time.Duration) (closed bool) {
	g.abandoned.Store(true)
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case g.sem <- struct{}{}:
	case <-t.C:
		if c := tx.Conn(); c != nil && c.PgConn() != nil {
			_ = c.PgConn().Conn().Close()
			closed = true
		}
		g.sem <- struct{}{}
	}
	<-g.sem
	return closed
}

// guardedTx is the pgx.Tx handed to a time-limited same-database task.
// Conn and LargeObjects give access to the connection outside the guard:
// a task that uses them must stop when its context ends.
type guardedTx struct {
	g  *txGuard
	tx pgx.Tx
}

var _ pgx.Tx = (*guardedTx)(nil)

func (t *guardedTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if err := t.g.acquire(); err != nil {
		return nil, err
	}
	defer t.g.release()
	tx, err := t.tx.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return &guardedTx{g: t.g, tx: tx}, nil
}

func (t *guardedTx) Commit(ctx context.Context) error {
	if err := t.g.acquire(); err != nil {
		return err
	}
	defer t.g.release()
	return t.tx.Commit(ctx)
}

func (t *guardedTx) Rollback(ctx context.Context) error {
	if err := t.g.acquire(); err != nil {
		return err
	}
	defer t.g.release()
	return t.tx.Rollback(ctx)
}

func (t *guardedTx) CopyFrom(ctx context.Context, table pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	if err := t.g.acquire(); err != nil {
		return 0, err
	}
	defer t.g.release()
	return t.tx.CopyFrom(ctx, table, cols, src)
}

func (t *guardedTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if err := t.g.acquire(); err != nil {
		return errBatch{err}
	}
	return &guardedBatch{BatchResults: t.tx.SendBatch(ctx, b), g: t.g}
}

func (t *guardedTx) LargeObjects() pgx.LargeObjects { return t.tx.LargeObjects() }

func (t *guardedTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if err := t.g.acquire(); err != nil {
		return nil, err
	}
	defer t.g.release()
	return t.tx.Prepare(ctx, name, sql)
}

func (t *guardedTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if err := t.g.acquire(); err != nil {
		return pgconn.CommandTag{}, err
	}
	defer t.g.release()
	return t.tx.Exec(ctx, sql, args...)
}

func (t *guardedTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if err := t.g.acquire(); err != nil {
		return nil, err
	}
	rows, err := t.tx.Query(ctx, sql, args...)
	if err != nil {
		t.g.release()
		return nil, err
	}
	return &guardedRows{Rows: rows, g: t.g}, nil
}

func (t *guardedTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	rows, err := t.Query(ctx, sql, args...)
	return guardedRow{rows: rows, err: err}
}

func (t *guardedTx) Conn() *pgx.Conn { return t.tx.Conn() }

// guardedRows releases the guard when the rows are closed.
type guardedRows struct {
	pgx.Rows
	g    *txGuard
	once sync.Once
}

func (r *guardedRows) done() { r.once.Do(r.g.release) }

func (r *guardedRows) Close() {
	r.Rows.Close()
	r.done()
}

func (r *guardedRows) Next() bool {
	if r.Rows.Next() {
		return true
	}
	r.done()
	return false
}

// guardedRow is QueryRow's result, read as pgx's own.
type guardedRow struct {
	rows pgx.Rows
	err  error
}

func (r guardedRow) Scan(dest ...any) error {
	if r.err != nil {
		return r.err
	}
	rows := r.rows
	defer rows.Close()
	if !rows.Next() {
		if err := rows.Err(); err != nil {
			return err
		}
		return pgx.ErrNoRows
	}
	if err := rows.Scan(dest...); err != nil {
		return err
	}
	rows.Close()
	return rows.Err()
}

// guardedBatch releases the guard when the batch is closed.
type guardedBatch struct {
	pgx.BatchResults
	g    *txGuard
	once sync.Once
}

func (b *guardedBatch) Close() error {
	err := b.BatchResults.Close()
	b.once.Do(b.g.release)
	return err
}

// errBatch is the batch of an abandoned transaction.
type errBatch struct{ err error }

func (b errBatch) Exec() (pgconn.CommandTag, error) { return pgconn.CommandTag{}, b.err }
func (b errBatch) Query() (pgx.Rows, error)         { return nil, b.err }
func (b errBatch) QueryRow() pgx.Row                { return guardedRow{err: b.err} }
func (b errBatch) Close() error                     { return b.err }
func (b errBatch) Tx() pgx.Tx                       { return nil }
