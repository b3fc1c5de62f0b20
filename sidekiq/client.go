package sidekiq

import (
	"bytes"
	"compress/zlib"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/url"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
	"go.uber.org/zap"
)

// Key names: Sidekiq's, and this package's own under "onceler:".
const (
	keyQueues     = "queues"
	keySchedule   = "schedule"
	keyRetry      = "retry"
	keyDead       = "dead"
	keyProcesses  = "processes"
	keyWorkingReg = "onceler:working"
	keyEpoch      = "onceler:epoch"
	keyOpPrefix   = "onceler:op:"
)

// How long the outcome of a fetch or a settlement is remembered, so that a
// call repeated after its reply was lost (go-redis retries a command on a
// broken connection) returns the first outcome instead of acting again.
const (
	fetchMemoTTL  = 300 // seconds; removed when the job is settled
	settleMemoTTL = 60
)

// copyField is added to a job stored in a sorted set that already holds
// the same string (two identical jobs), so that both are kept.
const copyField = "onceler_copy"

// unreadableClass is the "class" of the dead-set entry that wraps a value
// that is JSON but not a job hash (see Kill).
const unreadableClass = "Onceler::UnreadableJob"

// invalidRetryCountClass is the error_class of a job sent to the dead set
// because its retry_count is not a number.
const invalidRetryCountClass = "Onceler::InvalidRetryCount"

func newOpID() string {
	return strconv.FormatUint(rand.Uint64(), 36) + strconv.FormatUint(rand.Uint64(), 36)
}

func queueKey(q string) string { return "queue:" + q }

// WorkingKey returns the name of the working list of the process identity
// for the queue q: the jobs it fetched from q and has not settled yet.
func WorkingKey(identity, q string) string { return keyWorkingReg + ":" + identity + ":" + q }

// ErrNotHeld is returned (wrapped) by Done, Requeue, Retry, Kill and
// Schedule when the job is not in this process's working list any more:
// it was recovered to its queue by another process, which took this one
// for dead, or by RequeueAll, and will run again. Nothing was written.
var ErrNotHeld = errors.New("sidekiq: job is not in the working list")

// A Client fetches Sidekiq jobs reliably and reports to Sidekiq as a
// process. Its methods are safe for concurrent use.
type Client struct {
	cfg      Config
	rdb      *redis.Client
	log      *zap.Logger
	queues   []string // expanded by weight
	uniq     []string
	strict   bool
	infoJSON string
	queuesJS string

	quiet  atomic.Bool
	closed chan struct{}
	once   sync.Once

	mu        sync.Mutex
	pending   []string // ids of fetches whose outcome is unknown
	work      map[*Job]workEntry
	seq       uint64
	processed int64
	failed    int64
}

type workEntry struct {
	tid     string
	queue   string
	payload string
	runAt   int64
}

// connBufferSize and pipelineBufferSize are the read and write buffers of
// each Redis connection of a Client, and of its pipeline connections.
const (
	connBufferSize     = 4 << 10
	pipelineBufferSize = 16 << 10
)

// New returns a Client for cfg. It writes the first heartbeat, so the
// process is known (and its working lists are not taken for a dead
// process's) before it fetches; Run must then run for as long as the
// client fetches and settles jobs.
func New(cfg Config) (*Client, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	queues, strict, err := parseQueues(cfg.Queues)
	if err != nil {
		return nil, err
	}
	opt, err := redis.ParseURL(cfg.URL)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err // its message would repeat the URL, password included
		}
		return nil, fmt.Errorf("sidekiq: Redis URL %s: %w", RedactURL(cfg.URL), err)
	}
	opt.DisableIdentity = true
	if opt.PoolSize == 0 {
		// Fetch holds a connection while it blocks: room for one Fetch per
		// job run at once, and the heartbeat, scheduler and settling.
		opt.PoolSize = max(10*runtime.GOMAXPROCS(0), cfg.Concurrency+5)
	}
	// The pool holds a connection per job run at once, and go-redis gives
	// each 64 KiB of buffers by default: 16 MiB at the default concurrency,
	// which the collector then lets the heap grow several times over.
	// Sidekiq's replies and commands are small, and a larger one is read
	// and written through the buffer in pieces.
	if opt.ReadBufferSize == 0 {
		opt.ReadBufferSize = connBufferSize
	}
	if opt.WriteBufferSize == 0 {
		opt.WriteBufferSize = connBufferSize
	}
	if opt.PipelineReadBufferSize == 0 {
		opt.PipelineReadBufferSize = pipelineBufferSize
	}
	if opt.PipelineWriteBufferSize == 0 {
		opt.PipelineWriteBufferSize = pipelineBufferSize
	}
	opt.MaintNotificationsConfig = &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
	c := &Client{
		cfg:    cfg,
		rdb:    redis.NewClient(opt),
		log:    cfg.Logger.With(zap.String("identity", cfg.Identity)),
		queues: queues,
		uniq:   uniq(queues),
		strict: strict,
		closed: make(chan struct{}),
		work:   map[*Job]workEntry{},
	}
	info := map[string]any{
		"hostname":    hostname(),
		"started_at":  nowFloat(),
		"pid":         pid(),
		"tag":         cfg.Tag,
		"concurrency": cfg.Concurrency,
		"queues":      c.uniq,
		"labels":      cfg.Labels,
		"identity":    cfg.Identity,
	}
	c.infoJSON = mustJSON(info)
	c.queuesJS = mustJSON(c.uniq)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.requeueLeftovers(ctx); err != nil {
		_ = c.rdb.Close()
		return nil, err
	}
	if err := c.beat(ctx, false, nil); err != nil {
		_ = c.rdb.Close()
		return nil, fmt.Errorf("sidekiq: first heartbeat to %s: %w", RedactURL(cfg.URL), err)
	}
	return c, nil
}

// Identity returns the process identity.
func (c *Client) Identity() string { return c.cfg.Identity }

// Close closes the connections; a Fetch waiting while quiet returns.
func (c *Client) Close() error {
	var err error
	c.once.Do(func() {
		close(c.closed)
		err = c.rdb.Close()
	})
	return err
}

// Quiet reports whether the process was told to stop taking jobs (a TSTP
// or TERM signal through Sidekiq's API): Fetch then hands out none.
func (c *Client) Quiet() bool { return c.quiet.Load() }

// order returns the queues in the order of this fetch (BasicFetch's
// queues_cmd).
func (c *Client) order() []string {
	if c.strict {
		return c.uniq
	}
	p := append([]string(nil), c.queues...)
	rand.Shuffle(len(p), func(i, j int) { p[i], p[j] = p[j], p[i] })
	return uniq(p)
}

// fetchScript registers the process's working lists, then moves the
// oldest job of the first non-empty queue to its working list and returns
// {queue, job, epoch}. The outcome is remembered under KEYS[1]: a repeated
// call returns the same job. KEYS: memo, registry, epochs, then queue and
// working list pairs; ARGV: identity, queues JSON, new epoch (used when
// the process has none), memo TTL, queue names.
var fetchScript = redis.NewScript(`
local m = redis.call('HMGET', KEYS[1], 'q', 'v', 'e')
if m[1] then return m end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
local e = redis.call('HGET', KEYS[3], ARGV[1])
if not e then
  e = ARGV[3]
  redis.call('HSET', KEYS[3], ARGV[1], e)
end
for i = 4, #KEYS, 2 do
  local v = redis.call('LMOVE', KEYS[i], KEYS[i+1], 'RIGHT', 'LEFT')
  if v then
    local q = ARGV[4 + (i - 2) / 2]
    redis.call('HSET', KEYS[1], 'q', q, 'v', v, 'e', e)
    redis.call('EXPIRE', KEYS[1], ARGV[4])
    return {q, v, e}
  end
end
return false
`)

// Fetch waits for a job and moves it from its queue to this process's
// working list (reliable fetch), where it stays until Done, Requeue,
// Retry, Kill or Schedule settles it, or until another process recovers
// it after this one died. Queues are taken in Sidekiq's order (strict or
// weighted). A job that cannot be decoded is returned with a *DecodeError
// (and its Raw and Queue), to be sent to the dead set with Kill. While
// the process is quiet, Fetch hands out nothing and waits for ctx.
func (c *Client) Fetch(ctx context.Context) (*Job, error) {
	for {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		if c.quiet.Load() {
			select {
			case <-ctx.Done():
				return nil, ctx.Err()
			case <-c.closed:
				return nil, errors.New("sidekiq: client closed")
			}
		}
		order := c.order()
		id := c.takePending()
		keys := make([]string, 0, 3+2*len(order))
		keys = append(keys, keyOpPrefix+id, keyWorkingReg, keyEpoch)
		args := make([]any, 0, 4+len(order))
		args = append(args, c.cfg.Identity, c.queuesJS, newOpID(), fetchMemoTTL)
		for _, q := range order {
			keys = append(keys, queueKey(q), WorkingKey(c.cfg.Identity, q))
			args = append(args, q)
		}
		res, err := fetchScript.Run(ctx, c.rdb, keys, args...).StringSlice()
		switch {
		case err == nil && len(res) == 3:
		case err != nil && !errors.Is(err, redis.Nil):
			// The move may have happened: the next Fetch asks for its
			// outcome again and hands out the job it moved.
			c.addPending(id)
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			return nil, fmt.Errorf("sidekiq: fetch: %w", err)
		default:
			// Nothing now: wait until the first queue has a job without
			// taking it (a move of its last element to itself), then move
			// it in the script above.
			wait := c.cfg.FetchTimeout
			if len(order) > 1 {
				wait = c.cfg.FetchPoll
			}
			q := queueKey(order[0])
			_, err = c.rdb.BLMove(ctx, q, q, "RIGHT", "RIGHT", wait).Result()
			if err != nil && !errors.Is(err, redis.Nil) {
				if ctx.Err() != nil {
					return nil, ctx.Err()
				}
				return nil, fmt.Errorf("sidekiq: wait for a job of %s: %w", order[0], err)
			}
			continue
		}
		q, raw, epoch := res[0], res[1], res[2]
		if ctx.Err() != nil || c.quiet.Load() {
			// Taken while stopping: back to the head of its queue.
			j := &Job{Raw: raw, Queue: q, epoch: epoch, fetchID: id}
			if err := c.Requeue(context.WithoutCancel(ctx), j); err != nil {
				return nil, fmt.Errorf("sidekiq: hand back a job fetched while stopping (it stays in the working list): %w", err)
			}
			continue
		}
		j, err := Decode(raw, q)
		j.epoch, j.fetchID = epoch, id
		return j, err
	}
}

func (c *Client) takePending() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	if n := len(c.pending); n > 0 {
		id := c.pending[n-1]
		c.pending = c.pending[:n-1]
		return id
	}
	return newOpID()
}

func (c *Client) addPending(id string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.pending = append(c.pending, id)
}

// settleScript takes a job out of the working list and, in the same
// script, puts it where it goes. It checks first what could fail, so that
// it either writes everything or nothing: the epoch of the process (a job
// fetched before a recovery is not held any more), the types of the keys
// it writes, and (sorted sets) that the target does not hold the same
// string already (-1: the caller makes the member unique). The outcome is
// remembered under KEYS[4] for a repeated call. KEYS: working list,
// target, epochs, memo, memo of the fetch, "queues"; ARGV: raw, mode,
// payload, score, dead cutoff, -dead max, identity, epoch ("" unchecked),
// queue name, memo TTL.
var settleScript = redis.NewScript(`
local prev = redis.call('GET', KEYS[4])
if prev then return tonumber(prev) end
local mode = ARGV[2]
if ARGV[8] ~= '' and redis.call('HGET', KEYS[3], ARGV[7]) ~= ARGV[8] then return 0 end
local function want(key, ty)
  local t = redis.call('TYPE', key).ok
  if t ~= 'none' and t ~= ty then
    return redis.error_reply('WRONGTYPE ' .. key .. ' is a ' .. t .. ', not a ' .. ty .. ': the job stays in the working list')
  end
end
local bad
if mode == 'requeue' then
  bad = want(KEYS[2], 'list') or want(KEYS[6], 'set')
elseif mode == 'zadd' or mode == 'dead' then
  bad = want(KEYS[2], 'zset')
end
if bad then return bad end
if (mode == 'zadd' or mode == 'dead') and redis.call('ZSCORE', KEYS[2], ARGV[3]) then return -1 end
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return 0 end
if mode == 'requeue' then
  redis.call('RPUSH', KEYS[2], ARGV[1])
  redis.call('SADD', KEYS[6], ARGV[9])
elseif mode == 'zadd' then
  redis.call('ZADD', KEYS[2], ARGV[4], ARGV[3])
elseif mode == 'dead' then
  redis.call('ZADD', KEYS[2], ARGV[4], ARGV[3])
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[5])
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, ARGV[6])
end
redis.call('SET', KEYS[4], '1', 'EX', ARGV[10])
redis.call('DEL', KEYS[5])
return 1
`)

// settle runs settleScript. For the sorted sets, msg (nil: payload as it
// is) is the job hash of payload: when the set holds the same string, the
// job is stored with copyField added, so that two identical jobs stay two.
func (c *Client) settle(ctx context.Context, j *Job, mode, target, payload string, msg map[string]any, score float64) error {
	if j == nil {
		return errors.New("sidekiq: nil job")
	}
	cutoff := nowFloat() - c.cfg.DeadTimeout.Seconds()
	fetchMemo := ""
	if j.fetchID != "" {
		fetchMemo = keyOpPrefix + j.fetchID
	}
	keys := []string{WorkingKey(c.cfg.Identity, j.Queue), target, keyEpoch, keyOpPrefix + newOpID(), fetchMemo, keyQueues}
	for copies := 1; ; copies++ {
		n, err := settleScript.Run(ctx, c.rdb, keys, j.Raw, mode, payload, fmtFloat(score), fmtFloat(cutoff),
			-c.cfg.DeadMaxJobs, c.cfg.Identity, j.epoch, j.Queue, settleMemoTTL).Int()
		if err != nil {
			return fmt.Errorf("sidekiq: %s job %s from %s (outcome unknown if the connection failed): %w", mode, j.JID, j.Queue, err)
		}
		switch n {
		case 0:
			return fmt.Errorf("sidekiq: %s job %s from %s: %w", mode, j.JID, j.Queue, ErrNotHeld)
		case 1:
			return nil
		}
		// The set holds this very string: store a distinct copy.
		if msg == nil && j.Fields != nil {
			msg = cloneMap(j.Fields)
		}
		if msg == nil || copies > 1000 {
			return fmt.Errorf("sidekiq: %s job %s from %s: %s holds the same job already", mode, j.JID, j.Queue, target)
		}
		msg[copyField] = copies
		payload = mustJSON(msg)
	}
}

// Done removes a finished job from the working list.
//
// Done, Requeue, Retry, Kill and Schedule return an error wrapping
// ErrNotHeld when the job is not held any more, and write nothing: it was
// recovered to its queue after this process was taken for dead, or by
// RequeueAll (also when the same job was fetched again since; a Job not
// made by Fetch is matched by its Raw only). Each remembers its outcome
// for a minute, so that a call go-redis repeats after a lost reply
// returns the first outcome; any other error (Redis unreachable) leaves
// the outcome unknown: the job is either settled or still held.
func (c *Client) Done(ctx context.Context, j *Job) error {
	return c.settle(ctx, j, "done", keyRetry, "", nil, 0)
}

// Requeue puts the job back at the head of its queue (fetched next, as
// Sidekiq's bulk_requeue does on shutdown) and out of the working list,
// atomically.
func (c *Client) Requeue(ctx context.Context, j *Job) error {
	if j == nil {
		return errors.New("sidekiq: nil job")
	}
	return c.settle(ctx, j, "requeue", queueKey(j.Queue), "", nil, 0)
}

// Schedule moves the job to the "schedule" set, to be enqueued again at
// at, and out of the working list, atomically. The job is stored as
// fetched, or with a field "onceler_copy" added when the set holds the
// same string already (two identical jobs stay two).
func (c *Client) Schedule(ctx context.Context, j *Job, at time.Time) error {
	if j == nil {
		return errors.New("sidekiq: nil job")
	}
	if j.Fields == nil {
		return fmt.Errorf("sidekiq: schedule job from %s: it is not a JSON object, kill it instead", j.Queue)
	}
	return c.settle(ctx, j, "zadd", keySchedule, j.Raw, nil, timeFloat(at))
}

// Kill moves the job to the dead set, out of the working list, at once:
// for jobs that cannot run (undecodable, bad input). A job that is a JSON
// object gets error_class, error_message and (when it has none) failed_at
// as Sidekiq's retry records them. An element that is JSON but not an
// object (an array, a number) would break Sidekiq's DeadSet, so it is
// wrapped in a job hash of class "Onceler::UnreadableJob" whose single
// argument is the element as a string, with a new jid and the error
// fields; an element that is not JSON is stored as it is (Sidekiq's API
// shows it as the argument of a job without class), or wrapped too when
// the dead set holds the same string already. A job stored in a sorted
// set (Kill, Retry, Schedule) that already holds the same string gets a
// field "onceler_copy" (1, 2, ...), so that two identical jobs stay two.
// The dead set is trimmed as Sidekiq's DeadSet#kill does.
func (c *Client) Kill(ctx context.Context, j *Job, errClass, errMsg string) error {
	if j == nil {
		return errors.New("sidekiq: nil job")
	}
	payload := j.Raw
	var msg map[string]any
	if j.Fields != nil {
		msg = cloneMap(j.Fields)
		msg["error_class"] = errClass
		msg["error_message"] = errorMessage(errMsg)
		if _, ok := msg["failed_at"]; !ok {
			msg["failed_at"] = nowFloat()
		}
		payload = mustJSON(msg)
	} else {
		msg = unreadable(j.Raw, j.Queue, errClass, errMsg)
		if json.Valid([]byte(j.Raw)) {
			payload = mustJSON(msg)
		} // else stored as it is, unless the dead set holds the same string
	}
	if err := c.settle(ctx, j, "dead", keyDead, payload, msg, nowFloat()); err != nil {
		return err
	}
	c.log.Warn("sidekiq job killed", zap.String("queue", j.Queue), zap.String("class", j.Class),
		zap.String("jid", j.JID), zap.String("error_class", errClass))
	return nil
}

// unreadable is the job hash that wraps a value that is JSON but not a job
// hash, for the dead set.
func unreadable(raw, queue, errClass, errMsg string) map[string]any {
	msg := map[string]any{
		"class": unreadableClass, "args": []any{raw}, "jid": newJID(),
		"error_class": errClass, "error_message": errorMessage(errMsg), "failed_at": nowFloat(),
		"retry": false,
	}
	if queue != "" {
		msg["queue"] = queue
	}
	return msg
}

// Retry records a failure of the job as Sidekiq's JobRetry does and takes
// the job out of the working list in the same script:
//
//   - "retry" false: the job is neither retried nor kept (Sidekiq only
//     calls its death handlers); Retry logs it and returns Discarded.
//   - otherwise (true, absent, or an integer maximum; default
//     Config.MaxRetries; "retry" true is written when absent, as a Ruby
//     worker's default option): "queue" becomes "retry_queue" when set;
//     error_message (at most 10000 characters), error_class; the first
//     failure sets failed_at and retry_count 0, later ones retried_at and
//     retry_count+1; error_backtrace when "backtrace" is true (all lines)
//     or a number of lines (zlib-deflated JSON in Base64, as Sidekiq).
//     While retry_count is below the maximum the job goes to the "retry"
//     set, due in retry_count**4 + 15 + rand(10)*(retry_count+1) seconds
//     (Retried); then to the dead set (Dead), unless its "dead" is false
//     (Discarded). A
//     retry_count that is a float counts truncated, as Ruby's arithmetic
//     on it does.
//   - a retry_count that is neither a number nor null/false (a string,
//     true), on which Sidekiq's retry itself fails: the job goes to the
//     dead set with error_class "Onceler::InvalidRetryCount" and an
//     error_message that names the value and the job's own error.
//
// An undecodable job (no Fields) goes to the dead set as Kill sends it
// (Dead). On an error the outcome is 0, none of them.
func (c *Client) Retry(ctx context.Context, j *Job, errClass, errMsg string, backtrace []string) (RetryOutcome, error) {
	if j == nil {
		return 0, errors.New("sidekiq: nil job")
	}
	if j.Fields == nil {
		if err := c.Kill(ctx, j, errClass, errMsg); err != nil {
			return 0, err
		}
		return Dead, nil
	}
	msg := cloneMap(j.Fields)
	maxRetries := c.cfg.MaxRetries
	switch v := msg["retry"].(type) {
	case nil:
		// Absent or null: the worker's option, Sidekiq's default true.
		msg["retry"] = true
	case bool:
		if !v {
			if err := c.settle(ctx, j, "done", keyRetry, "", nil, 0); err != nil {
				return 0, err
			}
			c.log.Warn("sidekiq job failed and is discarded (retry: false)", zap.String("queue", j.Queue),
				zap.String("class", j.Class), zap.String("jid", j.JID), zap.String("error_class", errClass),
				zap.String("error", errMsg))
			return Discarded, nil
		}
	case json.Number:
		if n, err := v.Int64(); err == nil {
			maxRetries = int(n)
		}
	}
	queue := j.Queue
	if rq, ok := msg["retry_queue"].(string); ok && rq != "" {
		queue = rq
	}
	msg["queue"] = queue
	msg["error_message"] = errorMessage(errMsg)
	msg["error_class"] = errClass
	now := nowFloat()
	count := 0
	if rc, ok := msg["retry_count"]; ok && rc != nil && rc != false {
		n, ok := countOf(rc)
		if !ok {
			msg["error_class"] = invalidRetryCountClass
			msg["error_message"] = errorMessage(fmt.Sprintf("retry_count %s is not a number, the job is not retried; it failed with %s: %s",
				mustJSON(rc), errClass, errMsg))
			if _, ok := msg["failed_at"]; !ok {
				msg["failed_at"] = now
			}
			if err := c.settle(ctx, j, "dead", keyDead, mustJSON(msg), msg, now); err != nil {
				return 0, err
			}
			c.log.Error("sidekiq job failed and has an invalid retry_count: moved to the dead set", zap.String("queue", j.Queue),
				zap.String("class", j.Class), zap.String("jid", j.JID), zap.String("error_class", errClass))
			return Dead, nil
		}
		msg["retried_at"] = now
		count = int(n) + 1
	} else {
		msg["failed_at"] = now
	}
	msg["retry_count"] = count
	if lines, ok := backtraceLines(msg["backtrace"], backtrace); ok {
		msg["error_backtrace"] = compressBacktrace(lines)
	}
	payload := mustJSON(msg)
	log := c.log.With(zap.String("queue", j.Queue), zap.String("class", j.Class), zap.String("jid", j.JID),
		zap.Int("retry_count", count), zap.String("error_class", errClass))
	if count < maxRetries {
		c4 := min(count, 10000) // beyond, the delay would overflow (and is centuries anyway)
		delay := c4*c4*c4*c4 + 15 + rand.IntN(10)*(c4+1)
		if err := c.settle(ctx, j, "zadd", keyRetry, payload, msg, now+float64(delay)); err != nil {
			return 0, err
		}
		log.Info("sidekiq job failed, retry scheduled", zap.Int("delay_s", delay))
		return Retried, nil
	}
	if d, ok := msg["dead"].(bool); ok && !d {
		if err := c.settle(ctx, j, "done", keyRetry, "", nil, 0); err != nil {
			return 0, err
		}
		log.Warn("sidekiq job retries exhausted, discarded (dead: false)")
		return Discarded, nil
	}
	if err := c.settle(ctx, j, "dead", keyDead, payload, msg, now); err != nil {
		return 0, err
	}
	log.Warn("sidekiq job retries exhausted, moved to the dead set")
	return Dead, nil
}

// RetryOutcome is where Retry sent a failed job.
type RetryOutcome int

// Retry's outcomes.
const (
	// Retried: the job is in the retry set, to run again.
	Retried RetryOutcome = iota + 1
	// Dead: the job is in the dead set (retries used up, or it cannot
	// be retried).
	Dead
	// Discarded: the job ended without being kept ("retry": false, or
	// "dead": false once its retries are used up).
	Discarded
)

// String returns "retried", "dead" or "discarded".
func (o RetryOutcome) String() string {
	switch o {
	case Retried:
		return "retried"
	case Dead:
		return "dead"
	case Discarded:
		return "discarded"
	}
	return "unknown"
}

// backtraceLines applies the job's "backtrace" option (job_retry.rb).
func backtraceLines(opt any, lines []string) ([]string, bool) {
	switch v := opt.(type) {
	case nil:
		return nil, false
	case bool:
		if !v {
			return nil, false
		}
		return lines, true
	}
	n := rubyToI(opt)
	if n < 0 { // Ruby's lines[0...-k]: all but the last k
		n = max(len(lines)+n, 0)
	}
	return lines[:min(n, len(lines))], true
}

// rubyToI is Ruby's to_i of a JSON value: numbers truncated, strings read
// up to the first non-digit.
func rubyToI(v any) int {
	switch v := v.(type) {
	case json.Number:
		f, _ := v.Float64()
		return int(f)
	case string:
		s := strings.TrimSpace(v)
		end := 0
		for end < len(s) && (s[end] >= '0' && s[end] <= '9' || end == 0 && (s[0] == '-' || s[0] == '+')) {
			end++
		}
		n, _ := strconv.Atoi(s[:end])
		return n
	}
	return 0
}

// compressBacktrace is Sidekiq's compress_backtrace: JSON, zlib deflate,
// Base64.encode64 (lines of 60 characters, each ending in a newline).
func compressBacktrace(lines []string) string {
	if lines == nil {
		lines = []string{}
	}
	var z bytes.Buffer
	w := zlib.NewWriter(&z)
	_, _ = w.Write([]byte(mustJSON(lines)))
	_ = w.Close()
	enc := base64.StdEncoding.EncodeToString(z.Bytes())
	var b strings.Builder
	for len(enc) > 60 {
		b.WriteString(enc[:60])
		b.WriteByte('\n')
		enc = enc[60:]
	}
	if enc != "" {
		b.WriteString(enc)
		b.WriteByte('\n')
	}
	return b.String()
}

// errorMessage is Sidekiq's exception_message: valid UTF-8, at most 10000
// characters.
func errorMessage(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	n := 0
	for i := range s {
		if n == 10000 {
			return s[:i]
		}
		n++
	}
	return s
}

func cloneMap(m map[string]any) map[string]any {
	out := make(map[string]any, len(m)+4)
	for k, v := range m {
		out[k] = v
	}
	return out
}

// mustJSON encodes v as Sidekiq.dump_json would (no HTML escaping).
func mustJSON(v any) string {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		// Only values decoded from JSON or built here are encoded.
		panic(fmt.Sprintf("sidekiq: encode %T: %v", v, err))
	}
	return strings.TrimSuffix(b.String(), "\n")
}

func nowFloat() float64 { return timeFloat(time.Now()) }

func timeFloat(t time.Time) float64 { return float64(t.UnixNano()) / 1e9 }

func fmtFloat(f float64) string { return strconv.FormatFloat(f, 'f', -1, 64) }
