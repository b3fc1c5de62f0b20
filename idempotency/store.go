package idempotency

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"
)

// DefaultSchema is the schema the tables live in unless Config.Schema says
// otherwise.
const DefaultSchema = "onceler"

// Status is the state of a record. See the package documentation for the
// state machine.
type Status string

// The states of a record.
const (
	// StatusClaimed: a delivery holds the claim (token and lease).
	StatusClaimed Status = "claimed"
	// StatusCompleted: the effect happened; final.
	StatusCompleted Status = "completed"
	// StatusFailed: the last run failed or was released; a later delivery
	// may claim it again.
	StatusFailed Status = "failed"
	// StatusHeld: a stale claim waits for a person to decide.
	StatusHeld Status = "held"
	// StatusSkipped: a stale claim was abandoned by policy (the rare miss).
	StatusSkipped Status = "skipped"
)

// Config configures a Store.
type Config struct {
	// Schema holds the tables. Default "onceler".
	Schema string
	// Logger receives structured logs. Default: no logging.
	Logger *zap.Logger
	// Batch configures group-commit batching of claims and completions.
	// Batching is on by default.
	Batch BatchConfig
}

// DefaultLinger is BatchConfig.Linger's default.
const DefaultLinger = 200 * time.Microsecond

// BatchConfig configures the group-commit batching of Claim and Complete.
// Concurrent calls queue up and a flusher writes them in one implicit
// transaction as soon as it is free, waiting (Linger at most) only for the
// callers of the last flush to come back: there is no fixed wait, so an
// idle store answers a lone call at once.
type BatchConfig struct {
	// Disabled sends every Claim and Complete as its own statement.
	Disabled bool
	// MaxSize is the most claims (and, separately, completions) in one
	// flush. Default 256.
	MaxSize int
	// Flushers is the most flushes running at once, each on one pool
	// connection; a flush beyond the first starts only when as many calls
	// are queued as the last flush carried. Default 1: one flush at a time
	// makes the largest batches and one WAL flush per batch, which measured
	// fastest from 1 to 256 callers with PostgreSQL on two cores (a second
	// flush's commit waits for the first's fsync). A database server with
	// cores and disks to spare may gain from 2.
	Flushers int
	// Linger is the most a flush waits for more calls when the queue holds
	// fewer than the last flush carried (the callers it answered are
	// coming back with their next calls): fuller flushes, fewer commits.
	// A lone call on an idle store does not wait. Default DefaultLinger;
	// negative: never.
	Linger time.Duration
	// GroupTx sets the transaction groups of RunTx calls (same-database
	// tasks): several concurrent calls run in one transaction, committed
	// once (a group commit). The group's claims go out as one statement
	// and the functions run one after another; when one fails, the group
	// is rolled back and run again with each member in a savepoint of its
	// own, so a failure stays its own (and the functions before it run a
	// second time, their first effects rolled back).
	//
	// 0 (the default): adaptive groups. A call that finds no other running
	// commits at once in a transaction of its own; calls that come while
	// others run wait for the next group, which takes as many as fit in
	// AdaptiveGroupBudget (20 ms) of function time, estimated from recent
	// functions, up to 256. One group at a time runs its statements (so
	// that groups never deadlock on each other's row locks), the next
	// beginning as the last commits; functions slower than 5 ms run in
	// transactions of their own, in parallel.
	// 1: off, each call in a transaction of its own.
	// N > 1: groups of up to N calls (at most 32), GroupFlushers at once.
	GroupTx int
	// GroupFlushers is the number of groups running at once, each on one
	// pool connection. Default 4 for fixed groups (GroupTx > 1). Adaptive
	// groups (default 2) run their statements one group at a time: the
	// others are committing.
	GroupFlushers int
	// Timeout bounds one flush. Default 30s.
	Timeout time.Duration
}

// Store is the durable idempotency record in PostgreSQL. It is safe for
// concurrent use. Close it to stop its flushers.
type Store struct {
	pool   *pgxpool.Pool
	schema string // sanitized identifier
	name   string
	log    *zap.Logger
	q      queries
	batch  *batcher // nil when batching is disabled
	txg    *txGroup // nil when BatchConfig.GroupTx is 1
	// plainArrays: the pool's connections send arguments without
	// describing the statement first (exec, simple protocol), so pgx
	// encodes them by their Go type: text[] arguments go as []string.
	plainArrays bool
}

var schemaName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,62}$`)

// New returns a Store on pool. It does not touch the database; call
// Migrate to create or upgrade the schema.
func New(pool *pgxpool.Pool, cfg Config) (*Store, error) {
	if pool == nil {
		return nil, errors.New("idempotency: nil pool")
	}
	if cfg.Schema == "" {
		cfg.Schema = DefaultSchema
	}
	if !schemaName.MatchString(cfg.Schema) {
		return nil, fmt.Errorf("idempotency: invalid schema name %q", cfg.Schema)
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	if cfg.Batch.MaxSize <= 0 {
		cfg.Batch.MaxSize = 256
	}
	if cfg.Batch.Flushers <= 0 {
		cfg.Batch.Flushers = 1
	}
	if cfg.Batch.Linger == 0 {
		cfg.Batch.Linger = DefaultLinger
	}
	if cfg.Batch.Timeout <= 0 {
		cfg.Batch.Timeout = 30 * time.Second
	}
	s := &Store{
		pool:   pool,
		schema: pgx.Identifier{cfg.Schema}.Sanitize(),
		name:   cfg.Schema,
		log:    cfg.Logger.With(zap.String("schema", cfg.Schema)),
	}
	s.q = newQueries(s.schema)
	switch pool.Config().ConnConfig.DefaultQueryExecMode {
	case pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol:
		s.plainArrays = true
	}
	if !cfg.Batch.Disabled {
		s.batch = newBatcher(s, cfg.Batch)
	}
	switch {
	case cfg.Batch.GroupTx > 1:
		cfg.Batch.GroupTx = min(cfg.Batch.GroupTx, 32)
		if cfg.Batch.GroupFlushers <= 0 {
			cfg.Batch.GroupFlushers = 4
		}
		s.txg = newTxGroup(s, cfg.Batch)
	case cfg.Batch.GroupTx <= 0:
		cfg.Batch.GroupTx = 0
		if cfg.Batch.GroupFlushers <= 0 {
			cfg.Batch.GroupFlushers = 2
		}
		s.txg = newTxGroup(s, cfg.Batch)
	}
	return s, nil
}

// Close stops the flushers; calls still queued fail with ErrClosed. It does
// not close the pool.
func (s *Store) Close() {
	if s.batch != nil {
		s.batch.close()
	}
	if s.txg != nil {
		s.txg.close()
	}
}

// BatchStats counts the work of the batcher since the Store was created.
type BatchStats struct {
	// Flushes is the number of batches written, each one transaction.
	Flushes int64
	// Ops is the number of claims and completions they carried.
	Ops int64
	// TxGroups is the number of transaction groups of two or more RunTx
	// calls run, TxGrouped the calls they carried, TxAlone the RunTx calls
	// run in transactions of their own while groups were on.
	TxGroups, TxGrouped, TxAlone int64
	// TxDeferred is the number of statements RunTx functions deferred
	// (Defer) that ran with their groups' others in one round trip.
	TxDeferred int64
}

// BatchStats returns the batcher's and the transaction groups' counters
// (zero when they are off).
func (s *Store) BatchStats() BatchStats {
	var st BatchStats
	if s.batch != nil {
		st.Flushes, st.Ops = s.batch.flushes.Load(), s.batch.rows.Load()
	}
	if s.txg != nil {
		st.TxGroups, st.TxGrouped, st.TxAlone = s.txg.groups.Load(), s.txg.grouped.Load(), s.txg.alone.Load()
		st.TxDeferred = s.txg.deferred.Load()
	}
	return st
}

// Token identifies one claim. Completion, renewal, failure and release
// require it, so an owner whose claim was taken over is fenced out.
type Token string

// NewToken returns a new random token (see ClaimParams.Token).
func NewToken() Token {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return Token(hex.EncodeToString(b[:]))
}

// Ref names a claim: the record and the token of the claimant.
type Ref struct {
	Task, Key string
	Token     Token
}

// ClaimParams describes one delivery that wants to run an operation.
type ClaimParams struct {
	// Task is the stable task name.
	Task string
	// Key is the operation key: the business operation the effect belongs to.
	Key string
	// Fingerprint is a hash of the canonical arguments; empty means none.
	Fingerprint []byte
	// Owner is the worker node name.
	Owner string
	// TaskID is the Celery task id of this delivery.
	TaskID string
	// Lease is how long the claim holds without renewal. Default 1 minute.
	Lease time.Duration
	// Message is the original delivery, kept for replaying held operations.
	// It may be nil; it is cleared when the record completes. A claim made
	// in the task's own transaction (RunTx) does not store it: such a claim
	// commits with its completion, except on the paths that hold it then
	// (a task that ended its transaction itself, then failed), which keep
	// Message or, when it is nil, what HeldMessage makes.
	Message []byte
	// HeldMessage, when not nil, makes the message for a hold when Message
	// is nil: called only when the operation is held, so that a caller
	// whose operations are rarely held need not encode every delivery. It
	// may return nil (nothing kept).
	HeldMessage func() []byte
	// AllowMismatch claims even when the stored fingerprint differs (the
	// stored fingerprint is replaced). By default a mismatch is reported as
	// OutcomeMismatch and nothing changes.
	AllowMismatch bool
	// Token is the token the claim takes; empty means a new one. A caller
	// whose claim ended with an unknown outcome (the connection was lost
	// after the claim was sent) claims again with the same token (NewToken
	// makes one to keep): if the lost claim committed, the record is claimed
	// with this token and the retry gets OutcomeFirst again, under the same
	// attempt and with the lease renewed, instead of finding its own claim
	// in progress and, once it lapses, stale. Use a token for one claim only:
	// once a claim's outcome is known, the next claim takes a new token.
	// RunTx's claims commit with their completions and never find a claimed
	// record their own, whatever its token: one that committed alone was
	// committed by a task that ended its transaction itself.
	Token Token
}

func (p *ClaimParams) validate() error {
	if p.Task == "" || p.Key == "" {
		return errors.New("idempotency: claim needs a task and a key")
	}
	if len(p.Task) > MaxTaskBytes || len(p.Key) > MaxKeyBytes {
		return fmt.Errorf("%w: task name of %d bytes (at most %d), key of %d bytes (at most %d)",
			ErrTooLong, len(p.Task), MaxTaskBytes, len(p.Key), MaxKeyBytes)
	}
	for _, v := range []string{p.Task, p.Key, p.Owner, p.TaskID} {
		if !utf8.ValidString(v) || strings.ContainsRune(v, 0) {
			return fmt.Errorf("idempotency: claim field %q is not valid UTF-8 text without NUL", v)
		}
	}
	if p.Lease <= 0 {
		p.Lease = time.Minute
	}
	if p.Token == "" {
		p.Token = NewToken()
	}
	return nil
}

// Outcome is what a claim found.
type Outcome int

// The outcomes of Claim and TakeOver.
const (
	// OutcomeFirst: claimed now, with a fresh token; run the task.
	OutcomeFirst Outcome = iota + 1
	// OutcomeCompleted: already done; Result holds the stored result.
	OutcomeCompleted
	// OutcomeInProgress: another delivery holds a live claim.
	OutcomeInProgress
	// OutcomeStale: another delivery's claim lapsed; apply the task's policy.
	OutcomeStale
	// OutcomeMismatch: same key, different arguments (fingerprint).
	OutcomeMismatch
	// OutcomeHeld: the operation waits for a person.
	OutcomeHeld
	// OutcomeSkipped: the operation was abandoned by policy.
	OutcomeSkipped
)

var outcomeNames = [...]string{"unknown", "first", "completed", "in_progress", "stale", "mismatch", "held", "skipped"}

// String returns the outcome's name, for logs and metrics.
func (o Outcome) String() string {
	if o < 0 || int(o) >= len(outcomeNames) {
		return "unknown"
	}
	return outcomeNames[o]
}

// Claim is the answer of Claim, TakeOver, RunTx and ApplyPolicy.
type Claim struct {
	Outcome Outcome
	// Token is the new claim's token when Outcome is OutcomeFirst, and the
	// lapsed claim's token when OutcomeStale (for Skip and Hold, which
	// succeed only while that claim is still the current one).
	Token   Token
	Attempt int
	Status  Status
	// Result is the stored JSON result when completed.
	Result []byte
	// Error is the error text of the last failure.
	Error      string
	LeaseUntil time.Time
	// Since is this process's clock just before the claim (or takeover)
	// was sent, when Outcome is OutcomeFirst: the database's lease began
	// no earlier. Keep counts the lease from it.
	Since time.Time
	// Owner and TaskID name the current claimant.
	Owner, TaskID string
}

// Ref returns the Ref of this claim for task and key.
func (c Claim) Ref(task, key string) Ref { return Ref{Task: task, Key: key, Token: c.Token} }
