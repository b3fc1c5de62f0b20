package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"pgregory.net/rapid"

	"github.com/onceler/onceler/idempotency"
)

// modelKey is what the model believes about one record.
type modelKey struct {
	status  idempotency.Status // "" = no record
	holder  int                // worker holding the current claim, -1 none
	token   idempotency.Token  // current token
	expired bool
	effects int // same-database keys: effects committed
}

// TestModel drives random interleavings of claim (single and concurrent
// bursts, and again with the worker's last token, as after a lost answer),
// take over, renew, complete, fail, lease expiry and same-database
// runs for a few keys against real Postgres, and checks after every step
// that the store agrees with a model and that: at most one worker holds a
// valid token per key, completed is final, and no same-database effect is
// counted twice. Two flushers (not the default one), so that concurrent
// bursts also meet in flushes running side by side.
func TestModel(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{Flushers: 2})
	tbl := e.effects(t)
	ctx := context.Background()
	var run atomic.Int64
	const workers, keys = 3, 3

	rapid.Check(t, func(rt *rapid.T) {
		task := fmt.Sprint("model", run.Add(1))
		outside := make([]modelKey, keys)
		samedb := make([]modelKey, keys)
		for i := range outside {
			outside[i].holder = -1
		}
		// tokens[w][k] is the last token worker w got for outside key k.
		var tokens [workers][keys]idempotency.Token
		key := func(k int) string { return fmt.Sprint("k", k) }
		param := func(w, k int) idempotency.ClaimParams {
			return idempotency.ClaimParams{Task: task, Key: key(k), Fingerprint: []byte("fp"),
				Owner: fmt.Sprint("w", w), TaskID: fmt.Sprint("t", w), Lease: time.Minute}
		}
		// expectClaim is the outcome the model predicts.
		expectClaim := func(m modelKey, takeover bool) idempotency.Outcome {
			switch {
			case m.status == "" || m.status == idempotency.StatusFailed:
				return idempotency.OutcomeFirst
			case m.status == idempotency.StatusCompleted:
				return idempotency.OutcomeCompleted
			case !m.expired:
				return idempotency.OutcomeInProgress
			case takeover:
				return idempotency.OutcomeFirst
			default:
				return idempotency.OutcomeStale
			}
		}
		apply := func(w, k int, c idempotency.Claim) {
			if c.Outcome == idempotency.OutcomeFirst {
				tokens[w][k] = c.Token
				outside[k] = modelKey{status: idempotency.StatusClaimed, holder: w, token: c.Token}
			}
		}
		claim := func(rt *rapid.T, takeover bool) {
			w := rapid.IntRange(0, workers-1).Draw(rt, "w")
			k := rapid.IntRange(0, keys-1).Draw(rt, "k")
			want := expectClaim(outside[k], takeover)
			var c idempotency.Claim
			var err error
			if takeover {
				c, err = e.store.TakeOver(ctx, param(w, k))
			} else {
				c, err = e.store.Claim(ctx, param(w, k))
			}
			if err != nil {
				rt.Fatal(err)
			}
			if c.Outcome != want {
				rt.Fatalf("claim(takeover=%v) %s: %v, model says %v", takeover, key(k), c.Outcome, want)
			}
			if c.Outcome == idempotency.OutcomeStale && c.Token != outside[k].token {
				rt.Fatalf("stale token differs")
			}
			apply(w, k, c)
		}
		// fenced checks an owner-only write against the model.
		owns := func(w, k int) bool {
			m := outside[k]
			return m.status == idempotency.StatusClaimed && m.holder == w && tokens[w][k] == m.token
		}
		checkOwned := func(rt *rapid.T, op string, err error, ok bool) {
			if ok && err != nil {
				rt.Fatalf("%s by the owner: %v", op, err)
			}
			if !ok && !errors.Is(err, idempotency.ErrFenced) && !errors.Is(err, idempotency.ErrNotFound) {
				rt.Fatalf("%s by a non-owner: %v, want fenced", op, err)
			}
		}

		rt.Repeat(map[string]func(*rapid.T){
			"claim":    func(rt *rapid.T) { claim(rt, false) },
			"takeover": func(rt *rapid.T) { claim(rt, true) },
			"reclaim": func(rt *rapid.T) {
				// A claim retried with the worker's last token, as after an
				// answer lost: its own current claim is first again (lease
				// renewed, even past it), anything else as for a claim.
				w, k := rapid.IntRange(0, workers-1).Draw(rt, "w"), rapid.IntRange(0, keys-1).Draw(rt, "k")
				if tokens[w][k] == "" {
					return
				}
				p := param(w, k)
				p.Token = tokens[w][k]
				want := expectClaim(outside[k], false)
				if owns(w, k) {
					want = idempotency.OutcomeFirst
				}
				c, err := e.store.Claim(ctx, p)
				if err != nil {
					rt.Fatal(err)
				}
				if c.Outcome != want || (want == idempotency.OutcomeFirst && c.Token != p.Token) {
					rt.Fatalf("reclaim %s with its token: %v %s, model says %v", key(k), c.Outcome, c.Token, want)
				}
				apply(w, k, c)
			},
			"burst": func(rt *rapid.T) {
				k := rapid.IntRange(0, keys-1).Draw(rt, "k")
				want := expectClaim(outside[k], false)
				var wg sync.WaitGroup
				res := make([]idempotency.Claim, workers)
				errs := make([]error, workers)
				for w := range workers {
					wg.Go(func() { res[w], errs[w] = e.store.Claim(ctx, param(w, k)) })
				}
				wg.Wait()
				firsts := 0
				for w := range workers {
					if errs[w] != nil {
						rt.Fatal(errs[w])
					}
					if res[w].Outcome == idempotency.OutcomeFirst {
						firsts++
						apply(w, k, res[w])
					} else if want == idempotency.OutcomeFirst && res[w].Outcome != idempotency.OutcomeInProgress {
						rt.Fatalf("burst loser saw %v", res[w].Outcome)
					} else if want != idempotency.OutcomeFirst && res[w].Outcome != want {
						rt.Fatalf("burst: %v, model says %v", res[w].Outcome, want)
					}
				}
				if (want == idempotency.OutcomeFirst) != (firsts == 1) || firsts > 1 {
					rt.Fatalf("burst: %d firsts, model expected %v", firsts, want)
				}
			},
			"renew": func(rt *rapid.T) {
				w, k := rapid.IntRange(0, workers-1).Draw(rt, "w"), rapid.IntRange(0, keys-1).Draw(rt, "k")
				ok := owns(w, k) && !outside[k].expired
				err := e.store.Renew(ctx, param(w, k).Ref(tokens[w][k]), time.Minute)
				checkOwned(rt, "renew", err, ok)
			},
			"complete": func(rt *rapid.T) {
				w, k := rapid.IntRange(0, workers-1).Draw(rt, "w"), rapid.IntRange(0, keys-1).Draw(rt, "k")
				ok := owns(w, k)
				_, err := e.store.Complete(ctx, param(w, k).Ref(tokens[w][k]), []byte(fmt.Sprint(w)))
				if !ok && err == nil && outside[k].status == idempotency.StatusCompleted && outside[k].token == tokens[w][k] {
					return // repeated completion by the same claim: a no-op
				}
				checkOwned(rt, "complete", err, ok)
				if ok {
					outside[k].status, outside[k].expired = idempotency.StatusCompleted, false
				}
			},
			"fail": func(rt *rapid.T) {
				w, k := rapid.IntRange(0, workers-1).Draw(rt, "w"), rapid.IntRange(0, keys-1).Draw(rt, "k")
				ok := owns(w, k)
				err := e.store.Fail(ctx, param(w, k).Ref(tokens[w][k]), "err")
				if !ok && err == nil && outside[k].status == idempotency.StatusFailed && outside[k].token == tokens[w][k] {
					return
				}
				checkOwned(rt, "fail", err, ok)
				if ok {
					outside[k].status, outside[k].holder, outside[k].expired = idempotency.StatusFailed, -1, false
				}
			},
			"expire": func(rt *rapid.T) {
				k := rapid.IntRange(0, keys-1).Draw(rt, "k")
				if outside[k].status == idempotency.StatusClaimed {
					e.expire(t, task, key(k))
					outside[k].expired = true
				}
			},
			"runtx": func(rt *rapid.T) {
				k := rapid.IntRange(0, keys-1).Draw(rt, "k")
				fail := rapid.Bool().Draw(rt, "fail")
				p := param(0, k)
				p.Key = "s" + p.Key
				c, err := e.store.RunTx(ctx, p, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
					if _, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ($1, 1)`, task+"/"+p.Key); err != nil {
						return nil, err
					}
					if fail {
						return nil, errors.New("task failed")
					}
					return []byte(`1`), nil
				})
				m := &samedb[k]
				switch {
				case m.status == idempotency.StatusCompleted:
					if err != nil || c.Outcome != idempotency.OutcomeCompleted {
						rt.Fatalf("runtx on completed: %v %v", c.Outcome, err)
					}
				case fail:
					if err == nil {
						rt.Fatal("runtx: failure not returned")
					}
				default:
					if err != nil || c.Outcome != idempotency.OutcomeFirst {
						rt.Fatalf("runtx: %v %v", c.Outcome, err)
					}
					m.status = idempotency.StatusCompleted
					m.effects++
				}
			},
			"": func(rt *rapid.T) { // invariants after every step
				for k := range keys {
					m := outside[k]
					r, err := e.store.Get(ctx, task, key(k))
					if m.status == "" {
						if !errors.Is(err, idempotency.ErrNotFound) {
							rt.Fatalf("record %s exists: %v", key(k), err)
						}
					} else {
						if err != nil {
							rt.Fatal(err)
						}
						if r.Status != m.status {
							rt.Fatalf("%s: status %v, model %v", key(k), r.Status, m.status)
						}
						valid := 0
						for w := range workers {
							if r.Status == idempotency.StatusClaimed && tokens[w][k] == r.Token {
								valid++
							}
						}
						if r.Status == idempotency.StatusClaimed && (valid != 1 || r.Token != m.token) {
							rt.Fatalf("%s: %d workers hold the current token", key(k), valid)
						}
					}
					s := samedb[k]
					n := e.count(t, `SELECT count(*) FROM `+tbl+` WHERE key = $1`, task+"/sk"+fmt.Sprint(k))
					if n != s.effects || n > 1 {
						rt.Fatalf("same-db %d: %d effects, model %d", k, n, s.effects)
					}
					_, err = e.store.Get(ctx, task, "sk"+fmt.Sprint(k))
					if (s.status == "") != errors.Is(err, idempotency.ErrNotFound) {
						rt.Fatalf("same-db record %d: %v (model %q)", k, err, s.status)
					}
				}
			},
		})
	})
}
