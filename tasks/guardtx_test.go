package tasks

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testkit"
)

// TestCommitRefusedByTriggerAnswered: a same-database task whose
// transaction is refused at COMMIT by a deferred constraint trigger of the
// task's own table (a business rule raising its own SQLSTATE, here class
// "OB", as applications do) is refused every time: nothing commits and the
// same run would be refused again. It is answered (the task's failure)
// within seconds, alone and in a transaction group, and the innocent
// members of the group are answered too.
func TestCommitRefusedByTriggerAnswered(t *testing.T) {
	t.Parallel()
	for _, group := range []int{0, 8} {
		t.Run(fmt.Sprintf("group%d", group), func(t *testing.T) { commitRefusedByTrigger(t, group) })
	}
}

func commitRefusedByTrigger(t *testing.T, group int) {
	e := newEnv(t)
	pool := testenvPool(t)
	ctx := context.Background()
	ledger := e.schema + ".ledger"
	for _, q := range []string{
		`CREATE TABLE ` + ledger + ` (op text PRIMARY KEY, amount int NOT NULL)`,
		`CREATE FUNCTION ` + e.schema + `.no_overdraft() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.amount < 0 THEN
        RAISE EXCEPTION 'overdraft on %', NEW.op USING ERRCODE = 'OB001';
    END IF;
    RETURN NULL;
END $$`,
		`CREATE CONSTRAINT TRIGGER no_overdraft AFTER INSERT ON ` + ledger + `
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION ` + e.schema + `.no_overdraft()`,
	} {
		if _, err := pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	type ledgerArgs struct {
		Op     string `json:"op"`
		Amount int    `json:"amount"`
	}
	r := NewRegistry()
	if err := Register(r, Task[ledgerArgs]{Name: "rv.post", Mode: ModeSameDB,
		Key: func(a ledgerArgs) (string, error) { return a.Op, nil },
		RunTx: func(ctx context.Context, tx pgx.Tx, _ *Call, a ledgerArgs) (any, error) {
			_, err := tx.Exec(ctx, `INSERT INTO `+ledger+` VALUES ($1, $2)`, a.Op, a.Amount)
			return "posted", err
		}}); err != nil {
		t.Fatal(err)
	}
	cfg := e.config()
	cfg.Concurrency = 8
	if group > 0 {
		cfg.Store = e.storeOn(pool, idempotency.BatchConfig{GroupTx: group})
	}
	e.start(r, cfg)
	replyTo, replies := e.replyQueue()
	amounts := []int{5, -1, 7, 9} // the second is refused at COMMIT
	for i, amount := range amounts {
		e.publish(&celeryproto.Message{Protocol: 2, Task: "rv.post", ID: taskID(i),
			Kwargs: map[string]any{"op": fmt.Sprint("op-", i), "amount": int64(amount)}, ReplyTo: replyTo, CorrelationID: taskID(i)})
	}
	res := collect(replies, len(amounts), 10*time.Second)
	for i, amount := range amounts {
		rs := res[taskID(i)]
		switch {
		case len(rs) != 1:
			t.Errorf("op-%d (amount %d): %d answers within 10 s, want 1", i, amount, len(rs))
		case amount >= 0 && rs[0]["status"] != "SUCCESS":
			t.Errorf("op-%d answered %v, want SUCCESS", i, rs[0])
		case amount < 0 && rs[0]["status"] != "FAILURE":
			t.Errorf("op-%d answered %v, want FAILURE", i, rs[0])
		}
	}
}

// TestChainedCommitSettled: a same-database task that sends "INSERT
// ...; COMMIT AND CHAIN" in one statement string, then fails, is refused
// the statement (ErrTxManaged): nothing of it commits, the caller is told
// FAILURE, and no claim is left behind.
func TestChainedCommitSettled(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	pool := testenvPool(t)
	ctx := context.Background()
	table := e.schema + ".chained"
	if _, err := pool.Exec(ctx, `CREATE TABLE `+table+` (op text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	r := NewRegistry()
	if err := Register(r, Task[opArgs]{Name: "rv.chain", Mode: ModeSameDB, Key: opKey,
		RunTx: func(ctx context.Context, tx pgx.Tx, _ *Call, a opArgs) (any, error) {
			// No arguments: pgx sends it by the simple protocol, all of it.
			if _, err := tx.Exec(ctx, `INSERT INTO `+table+` VALUES ('`+a.Op+`'); COMMIT AND CHAIN`); err != nil {
				return nil, err
			}
			return nil, errors.New("failed after its insert")
		}}); err != nil {
		t.Fatal(err)
	}
	e.start(r, e.config())
	replyTo, replies := e.replyQueue()
	e.publish(&celeryproto.Message{Protocol: 2, Task: "rv.chain", ID: taskID(1), Kwargs: map[string]any{"op": "op-1"},
		ReplyTo: replyTo, CorrelationID: taskID(1)})
	res := collect(replies, 1, 10*time.Second)
	testkit.WaitFor(t, "queue empty", 10*time.Second, func() bool { return e.queueDepth(e.queue) == 0 })
	var effects int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&effects); err != nil {
		t.Fatal(err)
	}
	rec, err := e.store.Get(ctx, "rv.chain", "op-1")
	t.Logf("answer %v; effects %d; record %v (%v)", res[taskID(1)], effects, rec.Status, err)
	if err == nil && rec.Status == idempotency.StatusClaimed {
		t.Errorf("message answered and acknowledged with its operation's claim left %q (effects committed: %d)", rec.Status, effects)
	}
	if rs := res[taskID(1)]; len(rs) != 1 || rs[0]["status"] != "FAILURE" || effects != 0 {
		t.Errorf("answered %v with %d effects, want one FAILURE and none", rs, effects)
	}
}

// TestChainedRollbackAnswered: a same-database task that sends
// "...; ROLLBACK AND CHAIN" in one statement string and returns nil is
// answered within seconds, as a task failure: it is never run again and
// again as if the record were away.
func TestChainedRollbackAnswered(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	pool := testenvPool(t)
	ctx := context.Background()
	table := e.schema + ".rolled"
	if _, err := pool.Exec(ctx, `CREATE TABLE `+table+` (op text)`); err != nil {
		t.Fatal(err)
	}
	r := NewRegistry()
	if err := Register(r, Task[opArgs]{Name: "rv.rollback", Mode: ModeSameDB, Key: opKey,
		RunTx: func(ctx context.Context, tx pgx.Tx, _ *Call, a opArgs) (any, error) {
			_, err := tx.Exec(ctx, `INSERT INTO `+table+` VALUES ('`+a.Op+`'); ROLLBACK AND CHAIN`)
			return "done", err
		}}); err != nil {
		t.Fatal(err)
	}
	e.start(r, e.config())
	replyTo, replies := e.replyQueue()
	e.publish(&celeryproto.Message{Protocol: 2, Task: "rv.rollback", ID: taskID(1), Kwargs: map[string]any{"op": "op-1"},
		ReplyTo: replyTo, CorrelationID: taskID(1)})
	res := collect(replies, 1, 10*time.Second)
	if rs := res[taskID(1)]; len(rs) != 1 {
		t.Errorf("not answered within 10 s")
	}
}

// TestEndedThenFailedHeldWithMessage: a same-database task that commits its
// transaction itself through the raw connection (which the worker cannot
// refuse) and then fails leaves its claim and its effect committed: the
// operation is held for a person, who decides from the outside world. The
// held record keeps the delivery, so that 'onceler resolve --retry' can
// republish it; without it the person can only resolve it completed. Alone
// and in a transaction group.
func TestEndedThenFailedHeldWithMessage(t *testing.T) {
	t.Parallel()
	for _, group := range []int{0, 8} {
		t.Run(fmt.Sprintf("group%d", group), func(t *testing.T) {
			e := newEnv(t)
			pool := testenvPool(t)
			ctx := context.Background()
			table := e.schema + ".ended"
			if _, err := pool.Exec(ctx, `CREATE TABLE `+table+` (op text PRIMARY KEY)`); err != nil {
				t.Fatal(err)
			}
			r := NewRegistry()
			if err := Register(r, Task[opArgs]{Name: "eh.commit_fail", Mode: ModeSameDB, Key: opKey,
				RunTx: func(ctx context.Context, tx pgx.Tx, _ *Call, a opArgs) (any, error) {
					if _, err := tx.Exec(ctx, `INSERT INTO `+table+` VALUES ($1)`, a.Op); err != nil {
						return nil, err
					}
					if _, err := tx.Conn().Exec(ctx, "COMMIT"); err != nil {
						return nil, err
					}
					return nil, errors.New("failed after committing its effect")
				}}); err != nil {
				t.Fatal(err)
			}
			cfg := e.config()
			if group > 0 {
				cfg.Store = e.storeOn(pool, idempotency.BatchConfig{GroupTx: group})
			}
			e.start(r, cfg)
			replyTo, replies := e.replyQueue()
			e.publish(&celeryproto.Message{Protocol: 2, Task: "eh.commit_fail", ID: taskID(1), Kwargs: map[string]any{"op": "op-1"},
				ReplyTo: replyTo, CorrelationID: taskID(1)})
			res := collect(replies, 1, 10*time.Second)
			testkit.WaitFor(t, "queue empty", 10*time.Second, func() bool { return e.queueDepth(e.queue) == 0 })
			if rs := res[taskID(1)]; len(rs) != 1 || rs[0]["status"] != "FAILURE" {
				t.Fatalf("answered %v, want one FAILURE", rs)
			}
			rec, err := e.store.Get(ctx, "eh.commit_fail", "op-1")
			if err != nil {
				t.Fatal(err)
			}
			if rec.Status != idempotency.StatusHeld {
				t.Fatalf("record %s (%s), want held", rec.Status, rec.Reason)
			}
			if len(rec.Message) == 0 {
				t.Fatalf("held record (%s) keeps no message: 'resolve --retry' cannot republish it", rec.Reason)
			}
			_, _, p, err := DecodeHeld(rec.Message)
			if err != nil || p == nil {
				t.Fatalf("kept message: %v", err)
			}
		})
	}
}
