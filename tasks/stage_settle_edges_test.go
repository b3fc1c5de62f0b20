package tasks

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/idempotency"
)

// Review edges of the forgotten-claim settlement (stage_settle.go, write:
// idempotency.ErrNotFound settled as ErrFenced).

// A task whose run SUCCEEDED (its outside effect happened, the worker holds
// its result) and whose claim the record then lost (an asynchronous
// failover, a deleted record) is run a second time automatically, whatever
// its stale-claim policy. hold promises "neither a repeat nor a loss, at the
// price of a person's decision" and skip "at most once" (guarantees.md): a
// certain second outside effect breaks both. The outcome is not even
// unknown here: the result is in hand.
func TestForgottenClaimRespectsPolicy(t *testing.T) {
	t.Parallel()
	for _, pol := range []Policy{PolicyHold, PolicySkip} {
		t.Run(pol.String(), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			pool := testenvPool(t)
			records := pgx.Identifier{e.schema, "records"}.Sanitize()
			var runs atomic.Int32
			name := "t.forget_" + pol.String()
			reg := NewRegistry()
			if err := Register(reg, Task[payArgs]{Name: name, Mode: ModeOutside, Policy: pol,
				Key: func(a payArgs) (string, error) { return a.OrderID, nil },
				Run: func(ctx context.Context, c *Call, a payArgs) (any, error) {
					if runs.Add(1) == 1 {
						// The outside effect happens; meanwhile the record
						// forgets the claim (as a promoted asynchronous
						// standby that never received it).
						if _, err := pool.Exec(ctx, `DELETE FROM `+records+` WHERE task = $1 AND key = $2`, name, c.Key); err != nil {
							return nil, fmt.Errorf("forget the claim: %w", err)
						}
					}
					return map[string]any{"order": a.OrderID}, nil
				}}); err != nil {
				t.Fatal(err)
			}
			e.start(reg, e.config())
			replyTo, replies := e.replyQueue()
			e.publish(payMessage(name, 0, "forgotten-"+pol.String(), replyTo))
			_ = collect(replies, 1, 20*time.Second)
			time.Sleep(2 * time.Second) // room for a second run to show
			if n := runs.Load(); n != 1 {
				t.Errorf("policy %s: the task ran %d times after its successful run's claim was forgotten, want 1 (its effect happened; the policy allows no automatic repeat)", pol, n)
			}
		})
	}
}

// A task whose effect happened but whose result the database refuses is
// held for a person and its caller told "operation held" (unstorable). When
// the claim is also forgotten, HoldOwn finds no record, write turns that
// into ErrFenced, and unstorable tells the caller the operation is held and
// acknowledges the message although nothing is held: no record, no kept
// message for 'onceler resolve --retry', nothing in 'onceler records --held'.
func TestUnstorableResultOfForgottenClaimIsHeld(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	pool := testenvPool(t)
	records := pgx.Identifier{e.schema, "records"}.Sanitize()
	var runs atomic.Int32
	reg := NewRegistry()
	if err := Register(reg, Task[payArgs]{Name: "t.forget_huge", Mode: ModeOutside, Policy: PolicyHold,
		Key: func(a payArgs) (string, error) { return a.OrderID, nil },
		Run: func(ctx context.Context, c *Call, a payArgs) (any, error) {
			if runs.Add(1) == 1 {
				if _, err := pool.Exec(ctx, `DELETE FROM `+records+` WHERE task = $1 AND key = $2`, "t.forget_huge", c.Key); err != nil {
					return nil, fmt.Errorf("forget the claim: %w", err)
				}
			}
			return json.RawMessage(`1e999999`), nil // beyond PostgreSQL's numeric range
		}}); err != nil {
		t.Fatal(err)
	}
	e.start(reg, e.config())
	replyTo, replies := e.replyQueue()
	e.publish(payMessage("t.forget_huge", 0, "huge-1", replyTo))
	res := results(t, replies, 1, 30*time.Second)
	r := res[taskID(0)]
	said := ""
	if len(r) == 1 {
		b, _ := json.Marshal(r[0]["result"])
		said = string(b)
	}
	rec, err := e.store.Get(context.Background(), "t.forget_huge", "huge-1")
	if strings.Contains(said, "operation held") && (err != nil || rec.Status != idempotency.StatusHeld || len(rec.Message) == 0) {
		t.Errorf("caller told %s, but the record is %q with %d bytes of message (%v): nothing is held, the message was acknowledged",
			said, rec.Status, len(rec.Message), err)
	}
}

// A hold task abandoned at its hard time limit while it still runs has its
// claim held at once (settleAbandoned: "a person decides"). When the
// claim is also forgotten, HoldOwn finds no record, write turns that into
// ErrFenced, settleAbandoned reads it as "settled already", and the caller
// is answered and the message acknowledged with nothing held: the effect
// may still happen, and no record or kept message says so.
func TestAbandonedForgottenClaimIsHeld(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	pool := testenvPool(t)
	records := pgx.Identifier{e.schema, "records"}.Sanitize()
	reg := NewRegistry()
	if err := Register(reg, Task[payArgs]{Name: "t.forget_stubborn", Mode: ModeOutside, Policy: PolicyHold,
		TimeLimit: 300 * time.Millisecond,
		Key:       func(a payArgs) (string, error) { return a.OrderID, nil },
		Run: func(ctx context.Context, c *Call, a payArgs) (any, error) {
			if _, err := pool.Exec(ctx, `DELETE FROM `+records+` WHERE task = $1 AND key = $2`, "t.forget_stubborn", c.Key); err != nil {
				return nil, fmt.Errorf("forget the claim: %w", err)
			}
			time.Sleep(2 * time.Second) // ignores its context: abandoned
			return map[string]any{"order": a.OrderID}, nil
		}}); err != nil {
		t.Fatal(err)
	}
	e.start(reg, e.config())
	replyTo, replies := e.replyQueue()
	e.publish(payMessage("t.forget_stubborn", 0, "stubborn-1", replyTo))
	res := results(t, replies, 1, 30*time.Second)
	rec, err := e.store.Get(context.Background(), "t.forget_stubborn", "stubborn-1")
	status := ""
	if r := res[taskID(0)]; len(r) > 0 {
		status = fmt.Sprint(r[0]["status"])
	}
	if err != nil || rec.Status != idempotency.StatusHeld {
		t.Errorf("abandoned hold task answered %s and acknowledged; record %q (%v), want held (its effect may still happen)", status, rec.Status, err)
	}
}

// guarantees.md: every repeat of an outside effect "is counted in
// `onceler repeats`". A forgotten claim's completion is written anew, so its
// effect runs once: there is no repeat to count, and the record is
// completed with the result (a second run would be a repeat counted
// nowhere).
func TestForgottenClaimRepeatIsCounted(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	pool := testenvPool(t)
	records := pgx.Identifier{e.schema, "records"}.Sanitize()
	var runs atomic.Int32
	reg := NewRegistry()
	if err := Register(reg, Task[payArgs]{Name: "t.forget_count", Mode: ModeOutside, Policy: PolicyRetry,
		Key: func(a payArgs) (string, error) { return a.OrderID, nil },
		Run: func(ctx context.Context, c *Call, a payArgs) (any, error) {
			if runs.Add(1) == 1 {
				if _, err := pool.Exec(ctx, `DELETE FROM `+records+` WHERE task = $1 AND key = $2`, "t.forget_count", c.Key); err != nil {
					return nil, fmt.Errorf("forget the claim: %w", err)
				}
			}
			return map[string]any{"order": a.OrderID}, nil
		}}); err != nil {
		t.Fatal(err)
	}
	e.start(reg, e.config())
	replyTo, replies := e.replyQueue()
	e.publish(payMessage("t.forget_count", 0, "count-1", replyTo))
	_ = results(t, replies, 1, 30*time.Second)
	time.Sleep(2 * time.Second) // room for a second run to show
	if n := runs.Load(); n != 1 {
		t.Errorf("the outside effect ran %d times, want once (a second run is a repeat counted nowhere)", n)
	}
	rec, err := e.store.Get(context.Background(), "t.forget_count", "count-1")
	if err != nil || rec.Status != idempotency.StatusCompleted {
		t.Errorf("record %q (%v), want completed", rec.Status, err)
	}
}
