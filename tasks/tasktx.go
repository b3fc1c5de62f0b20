package tasks

import (
	"context"
	"errors"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceler/onceler/internal/sqltext"
)

// ErrTxManaged is returned to a same-database task that tries to commit or
// roll back the transaction the worker handed it (with Commit, Rollback or
// a COMMIT, ROLLBACK, END, ABORT or PREPARE TRANSACTION statement). The
// worker commits the claim, the task's effect and the completion together
// when the task returns nil, and rolls everything back when it returns an
// error: return instead. Nested transactions (tx.Begin: savepoints) may be
// committed and rolled back as usual.
var ErrTxManaged = errors.New("tasks: the worker commits or rolls back a same-database task's transaction: return nil to commit, an error to roll back")

// taskTx is the transaction handed to a same-database task: the worker's,
// which the task may not end.
type taskTx struct {
	pgx.Tx
}

var _ pgx.Tx = (*taskTx)(nil)

// Commit refuses: the worker commits.
func (t *taskTx) Commit(context.Context) error { return ErrTxManaged }

// Rollback refuses: the worker rolls back when the task returns an error.
func (t *taskTx) Rollback(context.Context) error { return ErrTxManaged }

// Begin starts a nested transaction (a savepoint), which the task may end.
func (t *taskTx) Begin(ctx context.Context) (pgx.Tx, error) {
	tx, err := t.Tx.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return &nestedTx{Tx: tx}, nil
}

func (t *taskTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return execChecked(ctx, t.Tx, sql, args)
}

func (t *taskTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return queryChecked(ctx, t.Tx, sql, args)
}

func (t *taskTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return queryRowChecked(ctx, t.Tx, sql, args)
}

func (t *taskTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return sendBatchChecked(ctx, t.Tx, b)
}

// nestedTx is a savepoint inside the task's transaction: the task may
// commit (release) or roll it back, but not end the outer transaction by a
// statement.
type nestedTx struct {
	pgx.Tx
}

var _ pgx.Tx = (*nestedTx)(nil)

func (t *nestedTx) Begin(ctx context.Context) (pgx.Tx, error) {
	tx, err := t.Tx.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return &nestedTx{Tx: tx}, nil
}

func (t *nestedTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return execChecked(ctx, t.Tx, sql, args)
}

func (t *nestedTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return queryChecked(ctx, t.Tx, sql, args)
}

func (t *nestedTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return queryRowChecked(ctx, t.Tx, sql, args)
}

func (t *nestedTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return sendBatchChecked(ctx, t.Tx, b)
}

func execChecked(ctx context.Context, tx pgx.Tx, sql string, args []any) (pgconn.CommandTag, error) {
	if endsTx(sql) {
		return pgconn.CommandTag{}, ErrTxManaged
	}
	return tx.Exec(ctx, sql, args...)
}

func queryChecked(ctx context.Context, tx pgx.Tx, sql string, args []any) (pgx.Rows, error) {
	if endsTx(sql) {
		return nil, ErrTxManaged
	}
	return tx.Query(ctx, sql, args...)
}

func queryRowChecked(ctx context.Context, tx pgx.Tx, sql string, args []any) pgx.Row {
	if endsTx(sql) {
		return errRow{ErrTxManaged}
	}
	return tx.QueryRow(ctx, sql, args...)
}

func sendBatchChecked(ctx context.Context, tx pgx.Tx, b *pgx.Batch) pgx.BatchResults {
	for _, q := range b.QueuedQueries {
		if endsTx(q.SQL) {
			return errBatch{ErrTxManaged}
		}
	}
	return tx.SendBatch(ctx, b)
}

// errRow is the row of a refused query.
type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }

// endsTx reports whether sql, one statement or several separated by
// semicolons (which pgx sends as one when a query has no arguments), has a
// statement that ends the transaction: COMMIT, END, ABORT, ROLLBACK (but
// not ROLLBACK TO a savepoint), PREPARE TRANSACTION, COMMIT or ROLLBACK
// PREPARED, also AND CHAIN. Quoted text, quoted names, dollar-quoted bodies
// and comments are skipped. (A task that ends its transaction through
// tx.Conn() or a prepared statement, outside this check, is found when it
// returns: the worker finds the connection out of its transaction, its
// claim gone from it, or, after a rollback, its claim committed all the
// same (COMMIT AND CHAIN), and holds it.)
func endsTx(sql string) bool {
	for _, stmt := range statements(sql) {
		if endsTxStatement(stmt) {
			return true
		}
	}
	return false
}

// endsTxStatement is endsTx of one statement.
func endsTxStatement(stmt string) bool {
	s := skipBlanks(stmt)
	word := func() string {
		i := 0
		for i < len(s) && (s[i] == '_' || s[i] >= 'a' && s[i] <= 'z' || s[i] >= 'A' && s[i] <= 'Z' || s[i] >= '0' && s[i] <= '9') {
			i++
		}
		w := strings.ToLower(s[:i])
		s = skipBlanks(s[i:])
		return w
	}
	switch word() {
	case "commit", "end", "abort":
		return true
	case "rollback":
		next := word()
		if next == "work" || next == "transaction" {
			next = word()
		}
		return next != "to"
	case "prepare":
		return word() == "transaction" && !strings.HasPrefix(strings.ToLower(s), "as")
	}
	return false
}

// statements splits sql at the semicolons that end statements: not those
// inside quotes ('...', E'...', "..."), dollar quotes ($tag$...$tag$) or
// comments (-- and nested /* */).
func statements(sql string) []string {
	var out []string
	start := 0
	for i := 0; i < len(sql); {
		switch c := sql[i]; {
		case c == ';':
			out = append(out, sql[start:i])
			i++
			start = i
		case c == '\'' || c == '"':
			// A doubled quote stays inside; E'...' escapes with a backslash.
			escapes := c == '\'' && i > 0 && (sql[i-1] == 'E' || sql[i-1] == 'e')
			i++
			for i < len(sql) {
				if escapes && sql[i] == '\\' {
					i += 2
					continue
				}
				if sql[i] == c {
					if i+1 < len(sql) && sql[i+1] == c {
						i += 2
						continue
					}
					break
				}
				i++
			}
			i++
		case c == '-' && strings.HasPrefix(sql[i:], "--"):
			// PostgreSQL ends a line comment at either.
			if j := strings.IndexAny(sql[i:], "\n\r"); j >= 0 {
				i += j + 1
			} else {
				i = len(sql)
			}
		case c == '/' && strings.HasPrefix(sql[i:], "/*"):
			if end := sqltext.BlockCommentEnd(sql[i:]); end >= 0 {
				i += end
			} else {
				i = len(sql)
			}
		case c == '$':
			// $tag$ ... $tag$ (a tag is a name, or empty); $1 is a parameter.
			j := i + 1
			for j < len(sql) && (sql[j] == '_' || sql[j] >= 'a' && sql[j] <= 'z' || sql[j] >= 'A' && sql[j] <= 'Z' ||
				(j > i+1 && sql[j] >= '0' && sql[j] <= '9')) {
				j++
			}
			if j < len(sql) && sql[j] == '$' {
				tag := sql[i : j+1]
				if k := strings.Index(sql[j+1:], tag); k >= 0 {
					i = j + 1 + k + len(tag)
				} else {
					i = len(sql)
				}
				continue
			}
			i++
		default:
			i++
		}
	}
	return append(out, sql[start:])
}

// skipBlanks skips white space, semicolons and SQL comments; "" when a
// comment does not end.
func skipBlanks(s string) string {
	rest, _ := sqltext.SkipBlanks(s, " \t\r\n\f;")
	return rest
}
