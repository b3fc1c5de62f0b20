package idempotency

import (
	"context"
	"strings"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceler/onceler/internal/sqltext"
)

// Deferred is the effect of a RunTx function written as one SQL statement,
// handed to its transaction group with Defer instead of run on tx: the
// group sends the statements of its functions together, in one round trip,
// once they have all run.
type Deferred struct {
	// SQL is one statement that begins with SELECT, INSERT, UPDATE, DELETE,
	// MERGE, WITH, VALUES or TABLE: none of them can end the transaction.
	// One that ends or changes the transaction all the same commits
	// nothing after it: the group's deferred operations whose claims
	// committed with it are then held, the others run again on their own.
	SQL  string
	Args []any
	// Row reads the statement's first row into what the function would
	// have returned: its result replaces the function's. A statement that
	// returns no row finds pgx.ErrNoRows in Scan. nil: the statement runs
	// as with Exec, and the function's result stands.
	Row func(row pgx.Row) ([]byte, error)
}

// Defer hands d to the transaction group the RunTx function that got ctx
// runs in, and reports whether it took it. The group runs d in the same
// transaction as the function's claim and completion, after the functions
// of the members before it, so the effect is as if the function had run
// d itself. When Defer reports false (the function runs alone, in a
// savepoint, or d is not a statement Defer takes), the function runs d on
// tx itself. After a true, the function returns without using tx again
// (its result is d.Row's). Defer takes one statement per call of the
// function: a second Defer, or one after the function returned, reports
// false and makes the group run its members one by one instead, where
// nothing is deferred. A function that sent a statement through tx before
// Defer (it may have written) gets false: it runs d itself, so that what
// it wrote is never written twice should the group run it again.
func Defer(ctx context.Context, d Deferred) bool {
	return deferTo(ctx, d, true)
}

// deferTo is Defer; check: only statements Defer takes.
func deferTo(ctx context.Context, d Deferred, check bool) bool {
	slot, _ := ctx.Value(deferralKey{}).(*deferral)
	if slot == nil {
		return false
	}
	slot.mu.Lock()
	defer slot.mu.Unlock()
	switch {
	case slot.closed || slot.used:
		return false
	case slot.d != nil:
		slot.misused = true
		return false
	case check && (!deferrable(d.SQL) || !plainArgs(d.Args)):
		return false
	}
	slot.d = &d
	return true
}

type deferralKey struct{}

// withoutDeferral returns ctx without a deferral: a RunTx call inside the
// function of a group's member does not defer its statement to that
// member's group.
func withoutDeferral(ctx context.Context) context.Context {
	if ctx.Value(deferralKey{}) == nil {
		return ctx
	}
	return context.WithValue(ctx, deferralKey{}, (*deferral)(nil))
}

// deferral is where one member's function may put its statement (Defer).
type deferral struct {
	mu      sync.Mutex
	d       *Deferred
	closed  bool // the function returned
	misused bool // a second Defer
	used    bool // the function used its transaction (usedTx)
}

// use records that the function used its transaction.
func (s *deferral) use() {
	s.mu.Lock()
	s.used = true
	s.mu.Unlock()
}

// usedTx is the group's transaction as a function that may defer gets it.
// Once the function has sent anything through it (it may have written;
// its connection, Conn, is not counted: reading it, for its process id or
// its type map, is common), Defer refuses and the function runs its
// statement itself: a member that deferred has written nothing else, so
// that when another member ends the group's transaction before the
// deferred statements run (ended), it runs again in full without writing
// anything twice.
type usedTx struct {
	pgx.Tx
	slot *deferral
}

func (t usedTx) Begin(ctx context.Context) (pgx.Tx, error) { t.slot.use(); return t.Tx.Begin(ctx) }
func (t usedTx) Commit(ctx context.Context) error          { t.slot.use(); return t.Tx.Commit(ctx) }
func (t usedTx) Rollback(ctx context.Context) error        { t.slot.use(); return t.Tx.Rollback(ctx) }
func (t usedTx) LargeObjects() pgx.LargeObjects            { t.slot.use(); return t.Tx.LargeObjects() }

func (t usedTx) CopyFrom(ctx context.Context, table pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	t.slot.use()
	return t.Tx.CopyFrom(ctx, table, cols, src)
}

func (t usedTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	t.slot.use()
	return t.Tx.SendBatch(ctx, b)
}

func (t usedTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	t.slot.use()
	return t.Tx.Prepare(ctx, name, sql)
}

func (t usedTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	t.slot.use()
	return t.Tx.Exec(ctx, sql, args...)
}

func (t usedTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	t.slot.use()
	return t.Tx.Query(ctx, sql, args...)
}

func (t usedTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	t.slot.use()
	return t.Tx.QueryRow(ctx, sql, args...)
}

// withDeferral returns ctx with an open deferral for one function call.
func withDeferral(ctx context.Context) (context.Context, *deferral) {
	slot := &deferral{}
	return context.WithValue(ctx, deferralKey{}, slot), slot
}

// close ends the function's call: what it deferred, and whether it
// deferred twice.
func (s *deferral) close() (*Deferred, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	return s.d, s.misused
}

// deferredIn reports whether the function that got ctx deferred its
// statement: its work is then its own time and its statement's share of
// the group's batch together, which writeBatched measures.
func deferredIn(ctx context.Context) bool {
	slot, _ := ctx.Value(deferralKey{}).(*deferral)
	if slot == nil {
		return false
	}
	slot.mu.Lock()
	defer slot.mu.Unlock()
	return slot.d != nil
}

// deferrable reports whether sql begins (after blanks and comments) with a
// keyword of a statement that cannot end or change the transaction: a
// deferred statement runs among others in the group's transaction, and a
// COMMIT there would commit the claims of members whose statements come
// after it without their effects.
func deferrable(sql string) bool {
	s, ok := sqltext.SkipBlanks(sql, " \t\r\n\f")
	if !ok {
		return false
	}
	// The first word, as PostgreSQL reads an identifier: "select_x" is
	// not SELECT.
	end := strings.IndexFunc(s, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '_' || r == '$' || r >= 0x80)
	})
	if end < 0 {
		end = len(s)
	}
	switch strings.ToUpper(s[:end]) {
	case "SELECT", "INSERT", "UPDATE", "DELETE", "MERGE", "WITH", "VALUES", "TABLE":
		return true
	}
	return false
}

// plainArgs reports whether args are the statement's parameters alone, or
// named ones (pgx.NamedArgs), which only fill its placeholders. pgx reads a
// first argument that is a query option as such: another QueryRewriter
// could make the statement a different one, and the others apply to one
// query, not to a batch.
func plainArgs(args []any) bool {
	if len(args) == 0 {
		return true
	}
	switch args[0].(type) {
	case pgx.NamedArgs, pgx.StrictNamedArgs:
		return true
	case pgx.QueryRewriter, pgx.QueryExecMode, pgx.QueryResultFormats, pgx.QueryResultFormatsByOID:
		return false
	}
	return true
}

// FirstRow returns rows as a pgx.Row, its first row, as QueryRow does; the
// caller closes rows, which Scan does too.
func FirstRow(rows pgx.Rows) pgx.Row { return firstRow{rows} }

// firstRow is the pgx.Row of a statement's result: its first row.
type firstRow struct{ rows pgx.Rows }

func (r firstRow) Scan(dest ...any) error {
	defer r.rows.Close()
	if !r.rows.Next() {
		if err := r.rows.Err(); err != nil {
			return err
		}
		return pgx.ErrNoRows
	}
	if err := r.rows.Scan(dest...); err != nil {
		return err
	}
	r.rows.Close()
	return r.rows.Err()
}

// sendDeferred runs the statements the members deferred, in their order,
// in one round trip, and keeps each member's result. sent is false when a
// statement or a Row failed, or a result cannot be stored: the group then
// runs member by member (nothing of this attempt commits). ended: a
// statement ended the group's transaction (it committed or rolled back
// what came before it). The statements run in a savepoint, which the batch
// releases last: after such a statement the release fails, in the
// transaction PostgreSQL opens for the rest of the batch, so that nothing
// after the statement commits.
func sendDeferred(ctx context.Context, tx pgx.Tx, pending []*member) (sent, ended bool) {
	b := &pgx.Batch{}
	b.Queue("SAVEPOINT onceler_deferred")
	for _, m := range pending {
		// The prefix keeps pgx from taking the text for the name of a
		// statement prepared on the connection, which it would run instead.
		b.Queue(deferredPrefix+m.deferred.SQL, m.deferred.Args...)
	}
	b.Queue("RELEASE SAVEPOINT onceler_deferred")
	br := tx.SendBatch(ctx, b)
	sent, ended = readDeferred(br, pending)
	cerr := br.Close()
	if ended || endedTx(tx) {
		return false, true
	}
	return sent && cerr == nil && !failedTx(tx), false
}

// deferredPrefix begins the text of every deferred statement.
const deferredPrefix = "-- onceler: deferred\n"

// readDeferred reads the batch of sendDeferred. ended: a statement's
// command tag says it ended or changed the transaction (COMMIT AND CHAIN,
// ROLLBACK TO SAVEPOINT, ...), which the keyword check should have made
// impossible.
func readDeferred(br pgx.BatchResults, pending []*member) (sent, ended bool) {
	if _, err := br.Exec(); err != nil {
		return false, false
	}
	for _, m := range pending {
		result := m.result
		var tag pgconn.CommandTag
		var err error
		if m.deferred.Row == nil {
			tag, err = br.Exec()
		} else {
			rows, qerr := br.Query()
			if qerr != nil {
				if rows != nil {
					rows.Close()
				}
				err = qerr
			} else {
				result, err = m.deferred.Row(firstRow{rows})
				rows.Close()
				tag = rows.CommandTag()
				if err == nil {
					err = rows.Err()
				}
			}
		}
		if txControl(tag) {
			return false, true
		}
		if err == nil {
			err = m.keep(result)
		}
		if err != nil {
			return false, false
		}
	}
	_, err := br.Exec()
	return err == nil, false
}

// txControl reports whether tag is that of a statement that ends or
// changes the transaction.
func txControl(tag pgconn.CommandTag) bool {
	word, _, _ := strings.Cut(tag.String(), " ")
	switch word {
	case "COMMIT", "ROLLBACK", "BEGIN", "START", "SAVEPOINT", "RELEASE", "PREPARE", "SET":
		return true
	}
	return false
}
