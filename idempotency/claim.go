package idempotency

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"
)

// querier is what the statements run on: the pool or a transaction.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Claim claims the operation (p.Task, p.Key) for this delivery in one round
// trip and says what it found: OutcomeFirst (claimed now, run it, with a
// fresh token; a failed or released record is claimed again),
// OutcomeCompleted (with the stored result), OutcomeInProgress,
// OutcomeStale (the claimant's lease lapsed: apply the task's policy, see
// ApplyPolicy), OutcomeMismatch, OutcomeHeld or OutcomeSkipped. A
// duplicate (completed or in progress) is counted.
//
// With batching on, concurrent claims are written together; each caller
// still gets its own exact outcome.
func (s *Store) Claim(ctx context.Context, p ClaimParams) (Claim, error) {
	if err := p.validate(); err != nil {
		return Claim{}, err
	}
	since := time.Now()
	var c Claim
	var err error
	if s.batch != nil && !p.AllowMismatch {
		c, err = s.batch.claim(ctx, p)
	} else {
		c, err = s.claimOne(ctx, s.pool, p, false)
	}
	if c.Outcome == OutcomeFirst {
		c.Since = since
	}
	return c, err
}

// TakeOver is Claim that also takes over a stale claim, atomically: of
// several deliveries taking over the same lapsed claim exactly one gets
// OutcomeFirst (a new token, the attempt bumped, a takeover counted); the
// others see OutcomeInProgress. The old owner is fenced out. Use it for the
// retry and lookup policies.
func (s *Store) TakeOver(ctx context.Context, p ClaimParams) (Claim, error) {
	if err := p.validate(); err != nil {
		return Claim{}, err
	}
	since := time.Now()
	c, err := s.claimOne(ctx, s.pool, p, true)
	if c.Outcome == OutcomeFirst {
		c.Since = since
	}
	return c, err
}

func (s *Store) claimOne(ctx context.Context, q querier, p ClaimParams, takeover bool) (Claim, error) {
	r, err := s.claimRow(ctx, q, p, takeover)
	if err != nil {
		return Claim{}, writeError("claim", err)
	}
	return r.claim(p.Token), nil
}

func (s *Store) claimRow(ctx context.Context, q querier, p ClaimParams, takeover bool) (claimRow, error) {
	return s.claimRowWith(ctx, q, s.q.claimOne, p, takeover)
}

// claimRowWith is claimRow with sql, claimOne or claimOneTx.
func (s *Store) claimRowWith(ctx context.Context, q querier, sql string, p ClaimParams, takeover bool) (claimRow, error) {
	row := q.QueryRow(ctx, sql, p.Task, p.Key, string(p.Token), p.Owner, p.TaskID,
		p.Fingerprint, p.Lease.Microseconds(), p.Message, takeover, p.AllowMismatch)
	var r claimRow
	err := r.scan(row)
	return r, err
}

type claimRow struct {
	task, key, status, token string
	attempt                  int32
	result                   []byte
	errText                  string
	leaseUntil               *time.Time
	owner, taskID, note      string
}

func (r *claimRow) scan(row pgx.Row) error {
	return row.Scan(&r.task, &r.key, &r.status, &r.token, &r.attempt, &r.result, &r.errText,
		&r.leaseUntil, &r.owner, &r.taskID, &r.note)
}

// scanClaimRows reads the rows of the claimBatch statement (n claims) by
// task and key, and closes them.
func scanClaimRows(rs pgx.Rows, n int) (map[opKey]claimRow, error) {
	defer rs.Close()
	byKey := make(map[opKey]claimRow, n)
	for rs.Next() {
		var r claimRow
		if err := r.scan(rs); err != nil {
			return nil, err
		}
		byKey[opKey{r.task, r.key}] = r
	}
	return byKey, rs.Err()
}

func (r *claimRow) claim(mine Token) Claim {
	c := Claim{
		Token:   Token(r.token),
		Attempt: int(r.attempt),
		Status:  Status(r.status),
		Result:  r.result,
		Error:   r.errText,
		Owner:   r.owner,
		TaskID:  r.taskID,
	}
	if r.leaseUntil != nil {
		c.LeaseUntil = *r.leaseUntil
	}
	switch r.note {
	case "first", "takeover":
		c.Outcome = OutcomeFirst
		if Token(r.token) != mine {
			// Cannot happen: the row was claimed with another token.
			c.Outcome = OutcomeInProgress
		}
	case "completed":
		c.Outcome = OutcomeCompleted
	case "in_progress":
		c.Outcome = OutcomeInProgress
	case "stale":
		c.Outcome = OutcomeStale
	case "mismatch":
		c.Outcome = OutcomeMismatch
	case "held":
		c.Outcome = OutcomeHeld
	case "skipped":
		c.Outcome = OutcomeSkipped
	}
	if c.Outcome != OutcomeFirst && c.Outcome != OutcomeStale {
		c.Token = ""
	}
	return c
}

// Policy decides what happens to a stale claim (a claimant whose lease
// lapsed, typically a crashed worker) of an outside-system task.
type Policy int

// The stale-claim policies. The zero value is PolicyHold, the safe default.
const (
	// PolicyHold records the operation as held, keeps the message to replay
	// it, and waits for a person.
	PolicyHold Policy = iota
	// PolicyRetry takes over and runs again: the rare duplicate, counted.
	PolicyRetry
	// PolicySkip records the operation as skipped and does not run it: the
	// rare miss, counted.
	PolicySkip
	// PolicyLookup takes over and asks the outside system whether the
	// operation happened: found completes it with that result, not found
	// runs it again, an error falls back to the fallback policy.
	PolicyLookup
)

// String returns the policy's name.
func (p Policy) String() string {
	switch p {
	case PolicyHold:
		return "hold"
	case PolicyRetry:
		return "retry"
	case PolicySkip:
		return "skip"
	case PolicyLookup:
		return "lookup"
	}
	return fmt.Sprintf("Policy(%d)", int(p))
}

// LookupFunc asks the outside system whether the operation with this key
// happened, and if so what its result (JSON) is.
type LookupFunc func(ctx context.Context, key string) (result []byte, found bool, err error)

// StalePolicy is a task's declared answer to a stale claim.
type StalePolicy struct {
	Policy Policy
	// Fallback applies when Lookup returns an error. PolicyLookup here
	// means PolicyHold.
	Fallback Policy
	// Lookup is required by PolicyLookup.
	Lookup LookupFunc
	// LookupTimeout bounds a lookup: it runs under the takeover's lease,
	// and one that outlived the lease would let another delivery take the
	// operation over while this one goes on to run it. A lookup that runs
	// out of time counts as failed (Fallback). Default and most: half the
	// lease, so that the claim can still be renewed after it.
	LookupTimeout time.Duration
	// Reason is recorded on skipped and held records.
	Reason string
}

// ApplyPolicy settles a stale claim (stale is the OutcomeStale answer of
// Claim for p) by the task's policy. It returns OutcomeFirst with a token
// when the caller must run the task, OutcomeCompleted when the lookup found
// the operation done (recorded with its result), OutcomeSkipped or
// OutcomeHeld when recorded so, or whatever another delivery got to first
// (for example OutcomeInProgress when it won the takeover). On an error the
// policy may have taken the claim over with p.Token and failed after (the
// completion after a lookup, a fallback hold): claim again with a new
// token, or the claim would be the caller's own and run the task whatever
// the policy decided.
func (s *Store) ApplyPolicy(ctx context.Context, p ClaimParams, stale Claim, sp StalePolicy) (Claim, error) {
	if err := p.validate(); err != nil {
		return Claim{}, err
	}
	if stale.Outcome != OutcomeStale {
		return stale, nil
	}
	reason := sp.Reason
	if reason == "" {
		reason = "stale claim: policy " + sp.Policy.String()
	}
	switch sp.Policy {
	case PolicyRetry:
		return s.TakeOver(ctx, p)
	case PolicySkip:
		return s.settle(ctx, p, p.Ref(stale.Token), PolicySkip, reason, stale, true)
	case PolicyLookup:
		if sp.Lookup == nil {
			return Claim{}, errors.New("idempotency: policy lookup without a lookup function")
		}
		c, err := s.TakeOver(ctx, p)
		if err != nil || c.Outcome != OutcomeFirst {
			return c, err
		}
		timeout := sp.LookupTimeout
		if timeout <= 0 || timeout > p.Lease/2 {
			timeout = p.Lease / 2
		}
		lctx, cancel := context.WithTimeoutCause(ctx, timeout, fmt.Errorf("idempotency: lookup took longer than %s", timeout))
		result, found, lerr := sp.Lookup(lctx, p.Key)
		if lerr == nil && lctx.Err() != nil {
			// It answered only after its time: the lease may be gone.
			lerr = context.Cause(lctx)
		}
		cancel()
		switch {
		case lerr == nil && found:
			stored, err := s.Complete(ctx, p.Ref(c.Token), result)
			if err != nil {
				if IsDefinite(err) {
					// Done, but its result cannot be stored: held for a
					// person, who knows from the reason what the lookup found.
					return s.settle(ctx, p, p.Ref(c.Token), PolicyHold,
						"the lookup found the operation done, but its result could not be stored: "+err.Error(), c, false)
				}
				return Claim{}, fmt.Errorf("complete after lookup: %w", err)
			}
			c.Outcome, c.Status, c.Result, c.Token = OutcomeCompleted, StatusCompleted, stored, ""
			return c, nil
		case lerr == nil:
			return c, nil // not found: run it again, under the new claim
		}
		s.log.Warn("idempotency lookup failed, applying fallback policy",
			zap.String("task", p.Task), zap.String("fallback", sp.Fallback.String()), zap.Error(lerr))
		switch sp.Fallback {
		case PolicyRetry:
			return c, nil
		case PolicySkip:
			return s.settle(ctx, p, p.Ref(c.Token), PolicySkip, reason+" (lookup failed)", c, false)
		default:
			return s.settle(ctx, p, p.Ref(c.Token), PolicyHold, reason+" (lookup failed)", c, false)
		}
	default:
		return s.settle(ctx, p, p.Ref(stale.Token), PolicyHold, reason, stale, true)
	}
}

// Ref returns the Ref of this operation with token t.
func (p ClaimParams) Ref(t Token) Ref { return Ref{Task: p.Task, Key: p.Key, Token: t} }

// heldMessage is the message a hold of p keeps: Message, or what
// HeldMessage makes when Message is nil.
func (p ClaimParams) heldMessage() []byte {
	if p.Message == nil && p.HeldMessage != nil {
		return p.HeldMessage()
	}
	return p.Message
}

// inTx is p as a claim made in the task's own transaction (RunTx) writes
// it: without the message. Such a claim commits only with its completion,
// which clears the message, so storing it would only write it twice; the
// rare paths where a claim commits alone (a task that ended its
// transaction itself) hold it with the message they carry, and a
// redelivery brings its own.
func (p ClaimParams) inTx() ClaimParams {
	p.Message = nil
	return p
}

// settle records the claim ref as skipped or held (lapsedOnly: a stale
// claim of another delivery, settled only while its lease is over; false:
// the caller's own takeover); when another delivery moved the record first,
// or the stale claim's owner claimed it again, it reports the record as
// Claim finds it now.
func (s *Store) settle(ctx context.Context, p ClaimParams, ref Ref, pol Policy, reason string, c Claim, lapsedOnly bool) (Claim, error) {
	var err error
	if pol == PolicySkip {
		err = s.skip(ctx, ref, reason, lapsedOnly)
	} else {
		err = s.hold(ctx, ref, p.heldMessage(), reason, lapsedOnly)
	}
	switch {
	case err == nil:
		c.Token, c.LeaseUntil = "", time.Time{}
		if pol == PolicySkip {
			c.Outcome, c.Status = OutcomeSkipped, StatusSkipped
		} else {
			c.Outcome, c.Status = OutcomeHeld, StatusHeld
		}
		return c, nil
	case errors.Is(err, ErrFenced):
		return s.claimOne(ctx, s.pool, p, false)
	default:
		return Claim{}, err
	}
}
