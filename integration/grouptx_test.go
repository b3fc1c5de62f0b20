package integration

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/integration/replay"
)

// TestWorkerGroupTx queues 120 ledger credits, each twice, and then starts
// an onceler worker with --group-tx 16, with the default adaptive groups,
// or with none (--group-tx 1): either way every
// credit is entered once and every call answered, promptly; with groups
// the entries share transactions (their rows' xmin), without each has its
// own.
func TestWorkerGroupTx(t *testing.T) {
	t.Parallel()
	const ops = 120
	for _, tc := range []struct {
		name    string
		env     []string
		grouped bool
	}{
		{"group-tx 16", []string{"ONCELER_GROUP_TX=16"}, true},
		{"adaptive groups (the default)", nil, true},
		{"no groups", []string{"ONCELER_GROUP_TX=1"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			e := replay.NewEnv(t, replay.Config{Binary: oncelerBin, Command: []string{"worker", "--migrate"}})
			if err := migrateDemo(ctx, e.Pool); err != nil {
				t.Fatal(err)
			}
			account := "acct-" + e.Schema
			var ids []string
			for i := range ops {
				args := []any{account, fmt.Sprintf("%s-%d", e.Schema, i), 125}
				ids = append(ids, e.Send(demo.TaskCredit, args, nil), e.Send(demo.TaskCredit, args, nil))
			}
			t0 := time.Now()
			w := e.StartWorker(replay.WorkerOptions{Concurrency: 64, Prefetch: 256, Env: tc.env})
			if !e.WaitReplies(ids, 1, 60*time.Second) {
				t.Fatalf("%d of %d calls answered in 60 s\n%s", e.ReplyCount(), len(ids), w.LogTail(20))
			}
			took := time.Since(t0)
			w.Stop()
			for _, id := range ids {
				if r := e.Replies(id)[0]; r.Status != "SUCCESS" {
					t.Fatalf("call %s: %v", id, r)
				}
			}
			for i := range ops {
				n, err := demo.CountLedger(ctx, e.Pool, fmt.Sprintf("%s-%d", e.Schema, i))
				if err != nil || n != 1 {
					t.Fatalf("credit %d entered %d times (%v), want once", i, n, err)
				}
			}
			var txs int
			if err := e.Pool.QueryRow(ctx, `SELECT count(DISTINCT xmin::text) FROM onceler_demo.ledger WHERE account = $1`,
				account).Scan(&txs); err != nil {
				t.Fatal(err)
			}
			t.Logf("%d calls answered in %v; %d credits entered in %d transactions", len(ids), took.Round(time.Millisecond), ops, txs)
			// Adaptive groups leave calls to transactions of their own
			// while their functions measure slow (under -race on a busy
			// machine, say): some sharing is what holds everywhere.
			if tc.grouped && tc.env == nil && txs >= ops {
				t.Fatalf("%d credits in %d transactions with adaptive groups: none shared", ops, txs)
			}
			if tc.grouped && tc.env != nil && txs > ops/2 {
				t.Fatalf("%d credits in %d transactions: not grouped", ops, txs)
			}
			if !tc.grouped && txs != ops {
				t.Fatalf("%d credits in %d transactions without groups, want one each", ops, txs)
			}
		})
	}
}
