package tasks

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/idempotency"
)

// Stmt is the effect of a same-database task written as one SQL statement
// (Task.RunStmt), run in the transaction that holds the task's claim and
// completion.
type Stmt struct {
	// SQL is the statement. One that begins with SELECT, INSERT, UPDATE,
	// DELETE, MERGE, WITH, VALUES or TABLE, with plain or pgx.NamedArgs
	// arguments, runs with the other statements of its transaction group
	// in one round trip (idempotency.Defer); any other runs alone, as
	// RunTx's statements do.
	SQL  string
	Args []any
	// Result reads the statement's first row (its RETURNING clause, or a
	// SELECT's) into the task's result, which must be JSON-encodable; a
	// statement that returns no row finds pgx.ErrNoRows in Scan. nil: the
	// statement runs as with Exec, and the task's result is nil.
	Result func(row pgx.Row) (any, error)
}

// runStmt runs the statement of a RunStmt task on tx; with deferring, it
// hands it to the task's transaction group instead when the group takes it
// (idempotency.Defer), and the task's result is then the statement's
// Result, which the group reads.
func (h *handler) runStmt(ctx context.Context, tx pgx.Tx, c *Call, a any, deferring bool) (any, error) {
	s, err := h.stmt(c, a)
	if err != nil {
		return nil, err
	}
	if deferring && idempotency.Defer(ctx, s.deferred()) {
		return nil, nil
	}
	return s.run(ctx, tx)
}

// run runs the statement on tx.
func (s Stmt) run(ctx context.Context, tx pgx.Tx) (any, error) {
	if s.Result == nil {
		if _, err := tx.Exec(ctx, s.SQL, s.Args...); err != nil {
			return nil, err
		}
		return nil, nil
	}
	rows, err := tx.Query(ctx, s.SQL, s.Args...)
	if err != nil {
		if rows != nil {
			rows.Close()
		}
		return nil, err
	}
	// Closed whether Result reads the row or not: the connection's next
	// statement cannot go before.
	defer rows.Close()
	v, err := s.Result(idempotency.FirstRow(rows))
	if err != nil {
		return nil, err
	}
	rows.Close()
	return v, rows.Err()
}

// deferred is the statement as the record's transaction group runs it
// (idempotency.Defer): its Result, which runs in the group's goroutine,
// cannot panic there, and its value is encoded as execute encodes a
// task's result. An error of either makes the group run the task again
// on its own, where the error is the task's.
func (s Stmt) deferred() idempotency.Deferred {
	d := idempotency.Deferred{SQL: s.SQL, Args: s.Args}
	if s.Result != nil {
		d.Row = func(row pgx.Row) ([]byte, error) {
			v, err := protect(context.Background(), nil, func(context.Context, *Call) (any, error) { return s.Result(row) })
			if err != nil {
				return nil, fmt.Errorf("read the statement's row: %w", err)
			}
			return encodeResult(v)
		}
	}
	return d
}
