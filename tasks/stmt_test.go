package tasks

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// TestRunStmtTasks runs a same-database task written as one statement
// (RunStmt), every delivery crediting one row, through a worker at its
// defaults against RabbitMQ and PostgreSQL: each caller gets its own
// statement's row (its order and a balance no other got), every credit
// lands once, and under load the statements went to the database with
// their groups'. One operation's statement fails (a unique violation) and
// one's Result panics: those two callers get a FAILURE, theirs alone, and
// leave no effect.
func TestRunStmtTasks(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	pool := testenv.Pool(t)
	ctx := context.Background()
	ledger, total := e.schema+".stmt_ledger", e.schema+".stmt_total"
	if _, err := pool.Exec(ctx, `CREATE TABLE `+ledger+` (entry text PRIMARY KEY);
		CREATE TABLE `+total+` (id int PRIMARY KEY, cents bigint NOT NULL);
		INSERT INTO `+ledger+` VALUES ('taken')`); err != nil {
		t.Fatal(err)
	}
	sql := `WITH e AS (INSERT INTO ` + ledger + ` VALUES ($1))
INSERT INTO ` + total + ` AS t VALUES (1, $2) ON CONFLICT (id) DO UPDATE SET cents = t.cents + $2
RETURNING $1 || ':' || t.cents`
	reg := NewRegistry()
	if err := Register(reg, Task[payArgs]{Name: "t.stmt", Mode: ModeSameDB,
		Key: func(a payArgs) (string, error) { return a.OrderID, nil },
		RunStmt: func(c *Call, a payArgs) (Stmt, error) {
			entry := a.OrderID
			if a.OrderID == "stmt-7" {
				entry = "taken"
			}
			return Stmt{SQL: sql, Args: []any{entry, a.Amount}, Result: func(row pgx.Row) (any, error) {
				var s string
				if err := row.Scan(&s); err != nil {
					return nil, err
				}
				if a.OrderID == "stmt-13" {
					panic("result reader panics")
				}
				return s, nil
			}}, nil
		}}); err != nil {
		t.Fatal(err)
	}
	e.start(reg, e.config())
	replyTo, replies := e.replyQueue()
	const n = 400
	for i := range n {
		e.publish(payMessage("t.stmt", i, fmt.Sprintf("stmt-%d", i), replyTo))
	}
	res := results(t, replies, n, 60*time.Second)
	seen := map[string]bool{}
	for i := range n {
		order := fmt.Sprintf("stmt-%d", i)
		r := res[taskID(i)]
		if len(r) != 1 {
			t.Fatalf("%s: %d answers", order, len(r))
		}
		if i == 7 || i == 13 {
			if r[0]["status"] != "FAILURE" {
				t.Errorf("%s: %v, want FAILURE", order, r[0])
			}
			continue
		}
		s, _ := r[0]["result"].(string)
		got, bal, _ := strings.Cut(s, ":")
		if r[0]["status"] != "SUCCESS" || got != order || seen[bal] {
			t.Fatalf("%s: %v: not its own row", order, r[0])
		}
		seen[bal] = true
	}
	var entries, cents int64
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+ledger+`), (SELECT cents FROM `+total+`)`).Scan(&entries, &cents); err != nil {
		t.Fatal(err)
	}
	if entries != n-1 || cents != 100*(n-2) {
		t.Fatalf("%d ledger entries and %d cents, want %d and %d", entries, cents, n-1, 100*(n-2))
	}
	st := e.store.BatchStats()
	t.Logf("%+v", st)
	if st.TxDeferred == 0 {
		t.Fatal("no statement went with its group's: the test did not reach the case it checks")
	}
	testkit.WaitFor(t, "queue empty", 10*time.Second, func() bool { return e.queueDepth(e.queue) == 0 })
}

// TestRunStmtResultNeedNotRead: a Result that does not read the row (it
// answers a value of its own) leaves the connection free for the
// completion, alone as in a group: every delivery is answered, its
// statement ran once.
func TestRunStmtResultNeedNotRead(t *testing.T) {
	t.Parallel()
	for _, n := range []int{1, 100} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			pool := testenv.Pool(t)
			ctx := context.Background()
			ledger := e.schema + ".noscan_ledger"
			if _, err := pool.Exec(ctx, `CREATE TABLE `+ledger+` (entry text NOT NULL)`); err != nil {
				t.Fatal(err)
			}
			reg := NewRegistry()
			if err := Register(reg, Task[payArgs]{Name: "t.noscan", Mode: ModeSameDB,
				Key: func(a payArgs) (string, error) { return a.OrderID, nil },
				RunStmt: func(c *Call, a payArgs) (Stmt, error) {
					return Stmt{SQL: `INSERT INTO ` + ledger + ` VALUES ($1) RETURNING entry`, Args: []any{a.OrderID},
						Result: func(pgx.Row) (any, error) { return "credited", nil }}, nil
				}}); err != nil {
				t.Fatal(err)
			}
			e.start(reg, e.config())
			replyTo, replies := e.replyQueue()
			for i := range n {
				e.publish(payMessage("t.noscan", i, fmt.Sprintf("n-%d", i), replyTo))
			}
			res := results(t, replies, n, 30*time.Second)
			for i := range n {
				if r := res[taskID(i)]; len(r) != 1 || r[0]["status"] != "SUCCESS" || r[0]["result"] != "credited" {
					t.Fatalf("task %d: %v", i, r)
				}
			}
			var rows int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+ledger).Scan(&rows); err != nil || rows != n {
				t.Fatalf("%d ledger rows (%v), want %d", rows, err, n)
			}
		})
	}
}
