package cmd

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/workerhooks"
)

// crashCase is one demo task under crash injection: what to send, and how
// to check the outcome once a second worker has taken over.
type crashCase struct {
	task string
	args func(key string) []any
	// check verifies the reply and the effects; key is the operation key.
	check func(t *testing.T, s *stack, pool *pgxpool.Pool, point, key string, r reply)
}

func wantOK(t *testing.T, r reply, want string) {
	t.Helper()
	got := fmt.Sprint(r.OK)
	if r.Error != "" || got != want {
		t.Fatalf("reply %+v, want %s", r, want)
	}
}

func wantCount(t *testing.T, what string, n int, err error, want int) {
	t.Helper()
	if err != nil || n != want {
		t.Fatalf("%s = %d (err %v), want %d", what, n, err, want)
	}
}

func crashCases() []crashCase {
	ctx := context.Background()
	return []crashCase{
		{
			task: demo.TaskAdd,
			args: func(string) []any { return []any{2, 3} },
			check: func(t *testing.T, _ *stack, _ *pgxpool.Pool, _, _ string, r reply) {
				wantOK(t, r, "5")
			},
		},
		{
			task: demo.TaskFail,
			args: func(string) []any { return []any{"bad input"} },
			check: func(t *testing.T, _ *stack, _ *pgxpool.Pool, _, _ string, r reply) {
				if r.Error != "ValueError" || r.Message != "bad input" {
					t.Fatalf("reply %+v, want ValueError: bad input", r)
				}
			},
		},
		{
			task: demo.TaskCredit,
			args: func(key string) []any { return []any{key + "-acct", key, 1500} },
			check: func(t *testing.T, _ *stack, pool *pgxpool.Pool, _, key string, r reply) {
				wantOK(t, r, fmt.Sprintf("map[account:%s-acct balance:1500 entry_id:%s]", key, key))
				n, err := demo.CountLedger(ctx, pool, key)
				wantCount(t, "ledger rows", n, err, 1)
			},
		},
		{
			task: demo.TaskSleep,
			args: func(key string) []any { return []any{key, 0.2} },
			check: func(t *testing.T, _ *stack, pool *pgxpool.Pool, _, key string, r reply) {
				wantOK(t, r, fmt.Sprintf("map[op:%s slept:0.2]", key))
				n, err := demo.CountSleeps(ctx, pool, key)
				wantCount(t, "sleeps", n, err, 1)
			},
		},
		{
			task: demo.TaskCharge,
			args: func(key string) []any { return []any{key, 990} },
			check: func(t *testing.T, _ *stack, pool *pgxpool.Pool, _, key string, r reply) {
				wantOK(t, r, fmt.Sprintf("map[charge_id:charge:%s order_id:%s]", key, key))
				n, err := demo.CountGatewayCalls(ctx, pool, key)
				wantCount(t, "gateway calls", n, err, 1)
				n, err = demo.CountGatewayCharges(ctx, pool, key)
				wantCount(t, "gateway charges", n, err, 1)
			},
		},
		{
			task: demo.TaskFlaky,
			args: func(key string) []any { return []any{key, 1} },
			check: func(t *testing.T, _ *stack, _ *pgxpool.Pool, _, key string, r reply) {
				wantOK(t, r, fmt.Sprintf("map[attempts:2 op:%s]", key))
			},
		},
		{
			task: demo.TaskEmail,
			args: func(key string) []any { return []any{key, "ann@example.com", "hello"} },
			check: func(t *testing.T, _ *stack, pool *pgxpool.Pool, point, key string, r reply) {
				wantOK(t, r, fmt.Sprintf("map[message_id:%s sent:true]", key))
				n, err := demo.CountEmailSends(ctx, pool, key)
				wantCount(t, "email sends", n, err, 1)
			},
		},
	}
}

// TestCrashInjection kills the worker (SIGKILL, by ONCELER_CRASH_AT) at each
// point for each demo task, starts a second worker, and checks that the
// caller gets its result and each effect happened once. The email task has
// no reference and no lookup (policy hold): a crash before its outcome is
// recorded leaves the operation held (the caller is answered OperationHeld),
// and an operator resolves it.
func TestCrashInjection(t *testing.T) {
	t.Parallel()
	points := []string{workerhooks.AfterClaim, workerhooks.AfterEffect, workerhooks.BeforeAck}
	for _, c := range crashCases() {
		for _, point := range points {
			t.Run(c.task+"/"+point, func(t *testing.T) {
				t.Parallel()
				runCrashCase(t, c, point)
			})
		}
	}
}

func runCrashCase(t *testing.T, c crashCase, point string) {
	s := newStack(t)
	pool := testenv.Pool(t)
	key := testenv.Name("k")
	lease := []string{"--lease", "2s"}

	w1 := startWorker(t, s.with(map[string]string{"ONCELER_CRASH_AT": point, "ONCELER_CRASH_TASK": c.task}), lease...)
	if !strings.Contains(w1.stderr.String(), "crash injection armed") {
		t.Fatalf("worker did not log the armed crash injection:\n%s", w1.stderr.String())
	}
	// A held delivery is answered FAILURE OperationHeld and acknowledged;
	// the operator resolves the operation afterwards.
	held := c.task == demo.TaskEmail && point != workerhooks.BeforeAck
	timeout := 90 * time.Second
	sender := s.sendTasks(t, timeout, call{c.task, c.args(key)})
	_ = w1.wait(60 * time.Second)
	if !w1.killed() || !strings.Contains(w1.stderr.String(), `"at":"`+point+`"`) {
		t.Fatalf("worker was not killed at %s (exit %v):\n%s", point, w1.err, w1.stderr.String())
	}

	w2 := startWorker(t, s.env, lease...)
	if held {
		resolveHeldEmail(t, s, pool, point, key)
	}
	_, replies := sender.replies(timeout)
	w2.stop()
	if len(replies) != 1 {
		t.Fatalf("replies %+v, want one", replies)
	}
	if held {
		if replies[0].Error != "OperationHeld" {
			t.Fatalf("reply to the held delivery %+v, want OperationHeld", replies[0])
		}
		n, err := demo.CountEmailSends(context.Background(), pool, key)
		wantCount(t, "email sends", n, err, 1)
		return
	}
	c.check(t, s, pool, point, key, replies[0])
}

// resolveHeldEmail waits for the stale email claim to be held, checks what
// the crash left, and resolves it as an operator would: --retry when the
// mail was not sent (crash after the claim), --completed when it was.
func resolveHeldEmail(t *testing.T, s *stack, pool *pgxpool.Pool, point, key string) {
	t.Helper()
	ctx := context.Background()
	store, err := idempotency.New(pool, idempotency.Config{Schema: s.schema})
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	deadline := time.Now().Add(60 * time.Second)
	for {
		rec, err := store.Get(ctx, demo.TaskEmail, key)
		if err == nil && rec.Status == idempotency.StatusHeld {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("email record not held: %+v %v", rec, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	sends, err := demo.CountEmailSends(ctx, pool, key)
	if point == workerhooks.AfterClaim {
		wantCount(t, "email sends before resolving", sends, err, 0)
		r := runBin(t, s.env, "resolve", demo.TaskEmail, key, "--retry")
		if r.code != 0 || !strings.Contains(r.stdout, "released and republished to queue "+s.queue) {
			t.Fatalf("resolve --retry: exit %d\n%s%s", r.code, r.stdout, r.stderr)
		}
		// The republished message runs: the mail is sent once.
		for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(100 * time.Millisecond) {
			sends, err = demo.CountEmailSends(ctx, pool, key)
			if err == nil && sends == 1 {
				break
			}
			if time.Now().After(deadline) {
				wantCount(t, "email sends after resolve --retry", sends, err, 1)
			}
		}
		return
	}
	wantCount(t, "email sends before resolving", sends, err, 1)
	result := fmt.Sprintf(`{"message_id": %q, "sent": true}`, key)
	r := runBin(t, s.env, "resolve", demo.TaskEmail, key, "--completed", "--result", result)
	if r.code != 0 {
		t.Fatalf("resolve --completed: exit %d\n%s", r.code, r.stderr)
	}
	// The held delivery was acknowledged: the caller learns the outcome by
	// sending the operation again, which the record now answers.
	_, replies := s.sendTasks(t, 60*time.Second, call{demo.TaskEmail, []any{key, "ann@example.com", "hello"}}).replies(90 * time.Second)
	if len(replies) != 1 || fmt.Sprint(replies[0].OK) != fmt.Sprintf("map[message_id:%s sent:true]", key) {
		t.Fatalf("resend after resolve: %+v", replies)
	}
}
