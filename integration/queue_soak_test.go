package integration

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/idempotency"
)

// soakOp is one operation of a soak: its target (an index into the soak's
// targets), its key and how many jobs or messages were sent for it.
type soakOp struct {
	tg    int
	key   string
	sends int
}

// soakDriver sends a soak's batches, one every 3 s, while it kills (kill
// -9) one of the workers every 2 to 5 s and starts another in its place,
// until every batch is sent and the operations are settled, or the
// deadline passes.
type soakDriver struct {
	t       *testing.T
	rng     *rand.Rand
	batches int
	// sent is what the progress line calls what send sends ("jobs
	// pushed").
	sent string
	// send sends batch b; returns how many it sent.
	send func(b int) int
	// fault, if not nil, is given the number of batches sent after each
	// step; it injects a fault of the transport's own and reports true
	// when it is time to.
	fault func(sent int) bool
	// startWorker starts a worker in place of a killed one.
	startWorker func() *skWorker
	// settled reports whether nothing is left to run and every operation
	// is settled; count is how many operations are settled.
	settled func() bool
	count   func() int
	ops     int
	// start is when run started.
	start time.Time
}

// run drives the soak with workers until deadline after its start;
// returns its start, how many were sent and how many workers killed.
func (d *soakDriver) run(workers []*skWorker, deadline time.Duration) (start time.Time, sent, kills int) {
	t, rng, nb := d.t, d.rng, d.batches
	t.Helper()
	start = time.Now()
	d.start = start
	batches := 0
	nextSend, nextKill := start, start.Add(3*time.Second)
	lastLog := start.Add(-8 * time.Second)
	for time.Now().Before(start.Add(deadline)) {
		now := time.Now()
		switch {
		case batches < nb && !now.Before(nextSend):
			sent += d.send(batches)
			batches++
			nextSend = nextSend.Add(3 * time.Second)
		case d.fault != nil && d.fault(batches):
		case batches < nb && !now.Before(nextKill):
			i := rng.IntN(len(workers))
			workers[i].Kill()
			kills++
			workers[i] = d.startWorker()
			nextKill = time.Now().Add(time.Duration(2000+rng.IntN(3000)) * time.Millisecond)
		}
		if batches == nb && d.settled() {
			break
		}
		if time.Since(lastLog) > 10*time.Second {
			t.Logf("%s: %d %s, %d of %d operations settled, %d kills", time.Since(start).Round(time.Second), sent, d.sent,
				d.count(), d.ops, kills)
			lastLog = time.Now()
		}
		time.Sleep(100 * time.Millisecond)
	}
	return start, sent, kills
}

// soakCount counts the operations under prefix whose record is not
// claimed (-1 on error).
func soakCount(e *queueEnv, prefix string) int {
	var settled int
	err := e.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+pgx.Identifier{e.schema, "records"}.Sanitize()+
		` WHERE key LIKE $1 || '-%' AND status <> 'claimed'`, prefix).Scan(&settled)
	if err != nil {
		return -1
	}
	return settled
}

// soakEffects counts the effects of task's operations under prefix, by
// operation.
func soakEffects(t *testing.T, e *queueEnv, task, prefix string) map[string]int {
	t.Helper()
	var q string
	switch task {
	case skTargets()[0].task:
		q = `SELECT entry_id, count(*) FROM onceler_demo.ledger WHERE entry_id LIKE $1 || '-%' GROUP BY 1`
	case skTargets()[1].task:
		q = `SELECT order_id, count(*) FROM onceler_demo.gateway_calls WHERE order_id LIKE $1 || '-%' GROUP BY 1`
	default:
		q = `SELECT message_id, count(*) FROM onceler_demo.email_sends WHERE message_id LIKE $1 || '-%' GROUP BY 1`
	}
	rows, err := e.pool.Query(context.Background(), q, prefix)
	if err != nil {
		t.Fatalf("count effects of %s: %v", task, err)
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var k string
		var n int
		if err := rows.Scan(&k, &n); err != nil {
			t.Fatal(err)
		}
		out[k] = n
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// soakRow is one target's line of a soak's table.
type soakRow struct{ ops, sends, lost, dups, notCompleted int }

// soakOutcome is, by target, how many of ops there were, how many jobs or
// messages were sent for them, and how many have no effect, more than one
// effect or a record that is not completed.
func soakOutcome(t *testing.T, e *queueEnv, targets []skTarget, prefix string, ops []*soakOp) []soakRow {
	t.Helper()
	ctx := context.Background()
	effects := map[string]map[string]int{}
	for _, tg := range targets {
		effects[tg.task] = soakEffects(t, e, tg.task, prefix)
	}
	status := map[string]string{}
	rows, err := e.pool.Query(ctx, `SELECT task, key, status FROM `+pgx.Identifier{e.schema, "records"}.Sanitize()+` WHERE key LIKE $1 || '-%'`, prefix)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var task, key, st string
		if err := rows.Scan(&task, &key, &st); err != nil {
			t.Fatal(err)
		}
		status[task+"/"+key] = st
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	per := make([]soakRow, len(targets))
	for _, o := range ops {
		tg := targets[o.tg]
		r := &per[o.tg]
		r.ops++
		r.sends += o.sends
		switch n := effects[tg.task][o.key]; {
		case n == 0:
			r.lost++
		case n > 1:
			r.dups++
		}
		if status[tg.task+"/"+o.key] != string(idempotency.StatusCompleted) {
			r.notCompleted++
		}
	}
	return per
}

// soakReport logs head and the table of per (sends is the column name of
// what was sent: "jobs", "msgs"), and fails the soak named name if an
// operation was lost, had more than one effect or is not completed.
func soakReport(t *testing.T, name, head, sends string, targets []skTarget, per []soakRow) {
	t.Helper()
	var b strings.Builder
	b.WriteString(head)
	fmt.Fprintf(&b, "%-22s %6s %6s %5s %10s %13s\n", "task", "ops", sends, "lost", "unexp.dup", "not completed")
	var sum soakRow
	for i, tg := range targets {
		r := per[i]
		sum.ops += r.ops
		sum.sends += r.sends
		sum.lost += r.lost
		sum.dups += r.dups
		sum.notCompleted += r.notCompleted
		fmt.Fprintf(&b, "%-22s %6d %6d %5d %10d %13d\n", tg.task, r.ops, r.sends, r.lost, r.dups, r.notCompleted)
	}
	fmt.Fprintf(&b, "%-22s %6d %6d %5d %10d %13d\n", "total", sum.ops, sum.sends, sum.lost, sum.dups, sum.notCompleted)
	b.WriteString("\nlost: an operation with no effect; unexp.dup: an operation with more than one effect;\n" +
		"not completed: an operation whose record is not completed at the end.\n")
	t.Log(b.String())
	if sum.lost != 0 || sum.dups != 0 || sum.notCompleted != 0 {
		t.Errorf("%s soak: %d lost, %d unexpected duplicates, %d not completed, want 0, 0 and 0", name, sum.lost, sum.dups, sum.notCompleted)
	}
}
