package idempotency_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/onceler/onceler/idempotency"
)

func TestClaimCompleteDuplicate(t *testing.T) {
	t.Parallel()
	both(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		p := params("pay", "k1")
		c := mustClaim(t, e.store, p, idempotency.OutcomeFirst)
		if c.Token == "" || c.Attempt != 1 || c.Status != idempotency.StatusClaimed || c.Owner != "node1" || c.TaskID != "tid-k1" {
			t.Fatalf("first claim: %+v", c)
		}
		if time.Until(c.LeaseUntil) < 30*time.Second {
			t.Fatalf("lease until %v", c.LeaseUntil)
		}
		in := mustClaim(t, e.store, p, idempotency.OutcomeInProgress)
		if in.Token != "" || in.TaskID != "tid-k1" {
			t.Fatalf("in progress exposes %+v", in)
		}
		if _, err := e.store.Complete(ctx, p.Ref(c.Token), []byte(`{"paid":42}`)); err != nil {
			t.Fatal(err)
		}
		// Completing again with the same token is a no-op.
		if _, err := e.store.Complete(ctx, p.Ref(c.Token), []byte(`{"paid":42}`)); err != nil {
			t.Fatalf("repeat complete: %v", err)
		}
		d := mustClaim(t, e.store, p, idempotency.OutcomeCompleted)
		if string(d.Result) != `{"paid": 42}` {
			t.Fatalf("stored result %q", d.Result)
		}
		r := e.get(t, "pay", "k1")
		if r.Status != idempotency.StatusCompleted || r.Duplicates != 2 || r.LastDuplicateAt.IsZero() ||
			r.CompletedAt.IsZero() || r.Message != nil || !r.LeaseUntil.IsZero() {
			t.Fatalf("record %+v", r)
		}
		if _, err := e.store.Complete(ctx, p.Ref("bogus"), nil); !errors.Is(err, idempotency.ErrFenced) {
			t.Fatalf("complete with a wrong token: %v", err)
		}
		if _, err := e.store.Complete(ctx, idempotency.Ref{Task: "pay", Key: "nope", Token: "x"}, nil); !errors.Is(err, idempotency.ErrNotFound) {
			t.Fatalf("complete missing: %v", err)
		}
		if _, err := e.store.Complete(ctx, p.Ref(c.Token), []byte(`{bad`)); !errors.Is(err, idempotency.ErrInvalidResult) {
			t.Fatalf("invalid json: %v", err)
		}
	})
}

func TestFailThenReclaim(t *testing.T) {
	t.Parallel()
	both(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		p := params("pay", "k")
		c := mustClaim(t, e.store, p, idempotency.OutcomeFirst)
		if err := e.store.Fail(ctx, p.Ref(c.Token), "boom"); err != nil {
			t.Fatal(err)
		}
		if err := e.store.Fail(ctx, p.Ref(c.Token), "boom"); err != nil {
			t.Fatalf("repeat fail: %v", err)
		}
		if r := e.get(t, "pay", "k"); r.Status != idempotency.StatusFailed || r.Error != "boom" {
			t.Fatalf("after fail %+v", r)
		}
		c2 := mustClaim(t, e.store, p, idempotency.OutcomeFirst)
		if c2.Attempt != 2 || c2.Token == c.Token || c2.Error != "boom" {
			t.Fatalf("reclaim %+v", c2)
		}
		// The failed run's token is fenced out of the new claim.
		if _, err := e.store.Complete(ctx, p.Ref(c.Token), nil); !errors.Is(err, idempotency.ErrFenced) {
			t.Fatalf("old token complete: %v", err)
		}
		if err := e.store.Release(ctx, p.Ref(c2.Token)); err != nil {
			t.Fatal(err)
		}
		c3 := mustClaim(t, e.store, p, idempotency.OutcomeFirst)
		if c3.Attempt != 3 {
			t.Fatalf("after release %+v", c3)
		}
		st := repeatsFor(t, e, "pay")
		if st.Failures != 1 || st.Duplicates != 0 {
			t.Fatalf("repeats %+v (release is no failure)", st)
		}
	})
}

func TestMismatch(t *testing.T) {
	t.Parallel()
	both(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		p := params("pay", "k")
		c := mustClaim(t, e.store, p, idempotency.OutcomeFirst)
		other := p
		other.Fingerprint = []byte("different")
		m := mustClaim(t, e.store, other, idempotency.OutcomeMismatch)
		if m.Token != "" || m.Status != idempotency.StatusClaimed {
			t.Fatalf("mismatch %+v", m)
		}
		if _, err := e.store.Complete(ctx, p.Ref(c.Token), nil); err != nil {
			t.Fatal(err)
		}
		mustClaim(t, e.store, other, idempotency.OutcomeMismatch)
		// No fingerprint: not compared.
		none := p
		none.Fingerprint = nil
		mustClaim(t, e.store, none, idempotency.OutcomeCompleted)
		if st := repeatsFor(t, e, "pay"); st.Mismatches != 2 || st.Duplicates != 1 {
			t.Fatalf("repeats %+v", st)
		}
		// AllowMismatch: a failed record is claimed despite other arguments.
		q := params("pay", "k2")
		c = mustClaim(t, e.store, q, idempotency.OutcomeFirst)
		if err := e.store.Fail(ctx, q.Ref(c.Token), "x"); err != nil {
			t.Fatal(err)
		}
		q.Fingerprint = []byte("new")
		mustClaim(t, e.store, q, idempotency.OutcomeMismatch)
		q.AllowMismatch = true
		mustClaim(t, e.store, q, idempotency.OutcomeFirst)
		if r := e.get(t, "pay", "k2"); !bytes.Equal(r.Fingerprint, []byte("new")) {
			t.Fatalf("fingerprint %q", r.Fingerprint)
		}
	})
}

func TestStaleTakeOverFencesOldOwner(t *testing.T) {
	t.Parallel()
	both(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		p := params("ship", "k")
		old := mustClaim(t, e.store, p, idempotency.OutcomeFirst)
		e.expire(t, "ship", "k")
		st := mustClaim(t, e.store, p, idempotency.OutcomeStale)
		if st.Token != old.Token {
			t.Fatalf("stale claim carries token %q, want the lapsed %q", st.Token, old.Token)
		}
		// A lapsed lease cannot be renewed.
		if err := e.store.Renew(ctx, p.Ref(old.Token), time.Minute); !errors.Is(err, idempotency.ErrFenced) {
			t.Fatalf("renew lapsed: %v", err)
		}
		p2 := p
		p2.Owner, p2.TaskID = "node2", "tid-2"
		nw, err := e.store.TakeOver(ctx, p2)
		if err != nil {
			t.Fatal(err)
		}
		if nw.Outcome != idempotency.OutcomeFirst || nw.Attempt != 2 || nw.Token == old.Token || nw.Owner != "node2" {
			t.Fatalf("takeover %+v", nw)
		}
		// The slow old owner is fenced out of everything.
		_, completeErr := e.store.Complete(ctx, p.Ref(old.Token), []byte(`1`))
		for name, err := range map[string]error{
			"complete": completeErr,
			"renew":    e.store.Renew(ctx, p.Ref(old.Token), time.Minute),
			"fail":     e.store.Fail(ctx, p.Ref(old.Token), "late"),
			"release":  e.store.Release(ctx, p.Ref(old.Token)),
			"skip":     e.store.Skip(ctx, p.Ref(old.Token), "late"),
			"hold":     e.store.Hold(ctx, p.Ref(old.Token), nil, "late"),
			"lapse":    e.store.Lapse(ctx, p.Ref(old.Token)),
		} {
			if !errors.Is(err, idempotency.ErrFenced) {
				t.Errorf("old owner %s: %v, want ErrFenced", name, err)
			}
		}
		if err := e.store.Renew(ctx, p.Ref(nw.Token), time.Minute); err != nil {
			t.Fatal(err)
		}
		if _, err := e.store.Complete(ctx, p.Ref(nw.Token), []byte(`"ok"`)); err != nil {
			t.Fatal(err)
		}
		if r := e.get(t, "ship", "k"); r.Status != idempotency.StatusCompleted || string(r.Result) != `"ok"` || r.Owner != "node2" {
			t.Fatalf("record %+v", r)
		}
		// TakeOver of a live claim is just in progress.
		q := params("ship", "live")
		mustClaim(t, e.store, q, idempotency.OutcomeFirst)
		if c, err := e.store.TakeOver(ctx, q); err != nil || c.Outcome != idempotency.OutcomeInProgress {
			t.Fatalf("takeover live: %+v %v", c, err)
		}
		if s := repeatsFor(t, e, "ship"); s.Takeovers != 1 {
			t.Fatalf("repeats %+v", s)
		}
	})
}

// Lapse ends a live claim's lease: the next delivery finds it stale (the
// policy decides), not in progress and not claimable as new.
func TestLapseLeavesClaimStale(t *testing.T) {
	t.Parallel()
	both(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		p := params("mail", "k")
		c := mustClaim(t, e.store, p, idempotency.OutcomeFirst)
		mustClaim(t, e.store, p, idempotency.OutcomeInProgress)
		if err := e.store.Lapse(ctx, p.Ref(c.Token)); err != nil {
			t.Fatal(err)
		}
		st := mustClaim(t, e.store, p, idempotency.OutcomeStale)
		if st.Token != c.Token || st.Attempt != 1 {
			t.Fatalf("stale claim %+v, want the lapsed claim %q, attempt 1", st, c.Token)
		}
		if r := e.get(t, "mail", "k"); r.Status != idempotency.StatusClaimed || r.LeaseUntil.After(time.Now()) {
			t.Fatalf("record after lapse: %s, lease until %v", r.Status, r.LeaseUntil)
		}
		if err := e.store.Renew(ctx, p.Ref(c.Token), time.Minute); !errors.Is(err, idempotency.ErrFenced) {
			t.Fatalf("renew after lapse: %v, want ErrFenced", err)
		}
		if err := e.store.Lapse(ctx, params("mail", "none").Ref(c.Token)); !errors.Is(err, idempotency.ErrNotFound) {
			t.Fatalf("lapse of no record: %v, want ErrNotFound", err)
		}
	})
}

// A stale view cannot settle a live claim: A's claim (token T) had its
// answer lost and lapsed, B found it stale, then A claimed again with T (its
// own: first, a new lease). B's skip or hold is refused, B is told the
// operation is in progress, and A completes.
func TestSettleRefusesALiveClaim(t *testing.T) {
	t.Parallel()
	for _, pol := range []idempotency.Policy{idempotency.PolicySkip, idempotency.PolicyHold} {
		t.Run(pol.String(), func(t *testing.T) {
			e := newEnv(t, idempotency.BatchConfig{Disabled: true})
			ctx := context.Background()
			a := params("mail", "k")
			a.Token = idempotency.NewToken()
			mustClaim(t, e.store, a, idempotency.OutcomeFirst)
			e.expire(t, "mail", "k")
			b := params("mail", "k")
			b.Owner = "node2"
			stale := mustClaim(t, e.store, b, idempotency.OutcomeStale)
			ca := mustClaim(t, e.store, a, idempotency.OutcomeFirst)
			cb, err := e.store.ApplyPolicy(ctx, b, stale, idempotency.StalePolicy{Policy: pol})
			if err != nil || cb.Outcome != idempotency.OutcomeInProgress {
				t.Fatalf("B's %s on A's live claim: %+v %v, want in progress", pol, cb, err)
			}
			if _, err := e.store.Complete(ctx, a.Ref(ca.Token), []byte(`"sent"`)); err != nil {
				t.Fatalf("A's completion: %v", err)
			}
			if r := e.get(t, "mail", "k"); r.Status != idempotency.StatusCompleted || string(r.Result) != `"sent"` {
				t.Fatalf("record %s %s, want completed by A", r.Status, r.Result)
			}
		})
	}
}

// Once B's policy held A's lapsed claim, A's late Complete or Fail is
// fenced, also after a person resolved the record to the state A's call
// would have written.
func TestSettledClaimFencesItsOldOwner(t *testing.T) {
	t.Parallel()
	for _, completed := range []bool{true, false} {
		t.Run(fmt.Sprintf("resolved_completed=%v", completed), func(t *testing.T) {
			e := newEnv(t, idempotency.BatchConfig{Disabled: true})
			ctx := context.Background()
			a := params("mail", "k")
			ca := mustClaim(t, e.store, a, idempotency.OutcomeFirst)
			e.expire(t, "mail", "k")
			b := params("mail", "k")
			stale := mustClaim(t, e.store, b, idempotency.OutcomeStale)
			if c, err := e.store.ApplyPolicy(ctx, b, stale, idempotency.StalePolicy{Policy: idempotency.PolicyHold}); err != nil || c.Outcome != idempotency.OutcomeHeld {
				t.Fatalf("hold: %+v %v", c, err)
			}
			var err error
			if completed {
				if err := e.store.ResolveCompleted(ctx, "mail", "k", []byte(`"by a person"`)); err != nil {
					t.Fatal(err)
				}
				_, err = e.store.Complete(ctx, a.Ref(ca.Token), []byte(`"A's result"`))
			} else {
				if _, err := e.store.ResolveRetry(ctx, "mail", "k"); err != nil {
					t.Fatal(err)
				}
				err = e.store.Fail(ctx, a.Ref(ca.Token), "A failed")
			}
			if !errors.Is(err, idempotency.ErrFenced) {
				t.Errorf("the held claim's old owner: %v, want ErrFenced", err)
			}
		})
	}
}

func TestConcurrentClaimsExactlyOneFirst(t *testing.T) {
	t.Parallel()
	both(t, func(t *testing.T, e *env) {
		const n = 50
		p := params("pay", "same")
		outcomes := make([]idempotency.Outcome, n)
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := range n {
			wg.Go(func() {
				<-start
				c, err := e.store.Claim(context.Background(), p)
				if err != nil {
					t.Error(err)
					return
				}
				outcomes[i] = c.Outcome
			})
		}
		close(start)
		wg.Wait()
		firsts, progress := 0, 0
		for _, o := range outcomes {
			switch o {
			case idempotency.OutcomeFirst:
				firsts++
			case idempotency.OutcomeInProgress:
				progress++
			}
		}
		if firsts != 1 || progress != n-1 {
			t.Fatalf("firsts %d, in progress %d of %d", firsts, progress, n)
		}
		if r := e.get(t, "pay", "same"); r.Duplicates != n-1 || r.Attempt != 1 {
			t.Fatalf("record %+v", r)
		}
	})
}

func TestTakeOverRaceOneWins(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{Flushers: 2})
	ctx := context.Background()
	for round := range 10 {
		p := params("ship", "race")
		p.Key = p.Key + string(rune('a'+round))
		mustClaim(t, e.store, p, idempotency.OutcomeFirst)
		e.expire(t, p.Task, p.Key)
		const racers = 8
		res := make([]idempotency.Claim, racers)
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := range racers {
			wg.Go(func() {
				<-start
				c, err := e.store.TakeOver(ctx, p)
				if err != nil {
					t.Error(err)
				}
				res[i] = c
			})
		}
		close(start)
		wg.Wait()
		wins := 0
		for _, c := range res {
			if c.Outcome == idempotency.OutcomeFirst {
				wins++
			} else if c.Outcome != idempotency.OutcomeInProgress {
				t.Fatalf("loser saw %v", c.Outcome)
			}
		}
		if wins != 1 {
			t.Fatalf("round %d: %d winners", round, wins)
		}
		if r := e.get(t, p.Task, p.Key); r.Attempt != 2 {
			t.Fatalf("attempt %d", r.Attempt)
		}
	}
}

func TestKeepRenewsAndLosesLease(t *testing.T) {
	e := newEnv(t, idempotency.BatchConfig{})
	ctx := context.Background()
	// Each renewal has until a tenth of the lease before its end: 1 s here,
	// which a loaded CI machine's slowest round trip stays well inside.
	lease := 1500 * time.Millisecond

	p := params("long", "renewed")
	p.Lease = lease
	c := mustClaim(t, e.store, p, idempotency.OutcomeFirst)
	kctx, stop := e.store.Keep(ctx, p.Ref(c.Token), lease)
	time.Sleep(3 * lease) // the task runs past its original lease
	if kctx.Err() != nil {
		t.Fatalf("kept context ended: %v", context.Cause(kctx))
	}
	if r := e.get(t, "long", "renewed"); time.Until(r.LeaseUntil) <= 0 {
		t.Fatalf("lease not renewed: %v", r.LeaseUntil)
	}
	stop()
	stop()
	if _, err := e.store.Complete(ctx, p.Ref(c.Token), nil); err != nil {
		t.Fatal(err)
	}

	// Taken over while running: the heartbeat is fenced and cancels the task.
	q := params("long", "lost")
	q.Lease = lease
	c = mustClaim(t, e.store, q, idempotency.OutcomeFirst)
	kctx, stop = e.store.Keep(ctx, q.Ref(c.Token), lease)
	defer stop()
	e.expire(t, "long", "lost")
	if nw, err := e.store.TakeOver(ctx, q); err != nil || nw.Outcome != idempotency.OutcomeFirst {
		t.Fatalf("takeover: %+v %v", nw, err)
	}
	select {
	case <-kctx.Done():
	case <-time.After(2 * lease):
		t.Fatal("task not told to stop")
	}
	if !errors.Is(context.Cause(kctx), idempotency.ErrLeaseLost) {
		t.Fatalf("cause %v", context.Cause(kctx))
	}
	if _, err := e.store.Complete(ctx, q.Ref(c.Token), nil); !errors.Is(err, idempotency.ErrFenced) {
		t.Fatalf("complete after lease lost: %v", err)
	}
}

func TestKeepCancelsWhenDatabaseUnreachable(t *testing.T) {
	e := newEnv(t, idempotency.BatchConfig{Disabled: true})
	ctx := context.Background()
	lease := 900 * time.Millisecond
	p := params("long", "k")
	p.Lease = lease
	c := mustClaim(t, e.store, p, idempotency.OutcomeFirst)
	// Block renewals: hold the row lock in another transaction until the lease ends.
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SELECT 1 FROM `+e.schema+`.records WHERE task = 'long' AND key = 'k' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	kctx, stop := e.store.Keep(ctx, p.Ref(c.Token), lease)
	defer stop()
	select {
	case <-kctx.Done():
	case <-time.After(3 * lease):
		t.Fatal("task not stopped when the lease could not be renewed")
	}
	if el := time.Since(start); el > lease+200*time.Millisecond {
		t.Fatalf("stopped after %v, lease %v", el, lease)
	}
	if !errors.Is(context.Cause(kctx), idempotency.ErrLeaseLost) {
		t.Fatalf("cause %v", context.Cause(kctx))
	}
}

func repeatsFor(t *testing.T, e *env, task string) idempotency.RepeatStats {
	t.Helper()
	rs, err := e.store.Repeats(context.Background(), time.Now().Add(-time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rs {
		if r.Task == task {
			return r
		}
	}
	return idempotency.RepeatStats{Task: task}
}

// TestBatchIsolatesABadCall: a call the server refuses fails alone; the
// other calls of its batch get their own outcomes.
func TestBatchIsolatesABadCall(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{})
	ctx := context.Background()
	const n = 40
	var wg sync.WaitGroup
	errs := make([]error, n)
	tokens := make([]idempotency.Token, n)
	for i := range n {
		wg.Go(func() {
			p := params("mixed", fmt.Sprint("k", i))
			c, err := e.store.Claim(ctx, p)
			if err != nil {
				errs[i] = err
				return
			}
			tokens[i] = c.Token
			result := []byte(fmt.Sprintf(`{"n":%d}`, i))
			if i == 7 {
				result = []byte(`1e999999`) // valid JSON beyond jsonb's numeric range
			}
			_, errs[i] = e.store.Complete(ctx, p.Ref(c.Token), result)
		})
	}
	wg.Wait()
	for i, err := range errs {
		if (i == 7) != (err != nil) || (i == 7 && !idempotency.IsDefinite(err)) {
			t.Fatalf("call %d: %v", i, err)
		}
	}
	if r := e.get(t, "mixed", "k7"); r.Status != idempotency.StatusClaimed {
		t.Fatalf("bad call's record %v", r.Status)
	}
	if r := e.get(t, "mixed", "k8"); r.Status != idempotency.StatusCompleted || string(r.Result) != `{"n": 8}` {
		t.Fatalf("good call's record %+v", r)
	}
	if _, err := e.store.Claim(ctx, params("mixed", "nul\x00")); err == nil {
		t.Fatal("accepted a key with NUL")
	}
}

// TestCancelQueuedCall: a call still queued behind a busy flush gives up
// with its context's error (it was never written); the flush in flight
// finishes and answers its own caller.
func TestCancelQueuedCall(t *testing.T) {
	e := newEnv(t, idempotency.BatchConfig{Flushers: 1})
	ctx := context.Background()
	a := params("slow", "a")
	ca := mustClaim(t, e.store, a, idempotency.OutcomeFirst)
	if _, err := e.store.Complete(ctx, a.Ref(ca.Token), nil); err != nil {
		t.Fatal(err)
	}
	// Hold the row so the next flush (a duplicate claim of a) waits.
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SELECT 1 FROM `+e.schema+`.records WHERE key = 'a' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	leaderDone := make(chan idempotency.Claim, 1)
	go func() {
		c, err := e.store.Claim(ctx, a)
		if err != nil {
			t.Error(err)
		}
		leaderDone <- c
	}()
	// Wait until the leader's statement is blocked on the lock.
	deadline := time.Now().Add(10 * time.Second)
	for e.count(t, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%' || $1 || '%'`, e.schema) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the leader's claim never waited on the lock")
		}
		time.Sleep(10 * time.Millisecond)
	}
	qctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	_, err = e.store.Claim(qctx, params("slow", "b"))
	if !errors.Is(err, context.DeadlineExceeded) || idempotency.IsUnknownOutcome(err) {
		t.Fatalf("queued claim: %v, want its deadline and a definite outcome", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if c := <-leaderDone; c.Outcome != idempotency.OutcomeCompleted {
		t.Fatalf("leader %+v", c)
	}
	if _, err := e.store.Get(ctx, "slow", "b"); !errors.Is(err, idempotency.ErrNotFound) {
		t.Fatalf("cancelled claim was written: %v", err)
	}
	// The store still works.
	mustClaim(t, e.store, params("slow", "c"), idempotency.OutcomeFirst)
}

// TestLingerNeverHoldsALoneCall: with a linger of an hour, calls made one
// at a time are still answered at once (the last flush carried one, so
// there is nobody to wait for); after a burst, a lone call waits at most
// the linger.
func TestLingerNeverHoldsALoneCall(t *testing.T) {
	e := newEnv(t, idempotency.BatchConfig{Linger: time.Hour})
	for i := range 5 {
		done := make(chan error, 1)
		go func() {
			p := params("linger", fmt.Sprint("lone-", i))
			c, err := e.store.Claim(context.Background(), p)
			if err == nil {
				_, err = e.store.Complete(context.Background(), p.Ref(c.Token), []byte(`1`))
			}
			done <- err
		}()
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("lone call %d: %v", i, err)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("lone call %d held for 10 s by a linger of an hour", i)
		}
	}

	e = newEnv(t, idempotency.BatchConfig{Linger: 300 * time.Millisecond})
	var wg sync.WaitGroup
	for i := range 16 {
		wg.Go(func() {
			if _, err := e.store.Claim(context.Background(), params("linger", fmt.Sprint("burst-", i))); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	start := time.Now()
	mustClaim(t, e.store, params("linger", "after"), idempotency.OutcomeFirst)
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("a lone call after a burst took %v, want at most the linger (300ms) and a round trip", took)
	}
}
