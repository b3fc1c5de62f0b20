package sidekiq

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// statsTTL is how long the daily stat keys live (Sidekiq's STATS_TTL).
const statsTTL = 5 * 365 * 24 * time.Hour

// Begin records that the job started running: the process's busy count
// and its entry in "<identity>:workers" (Sidekiq::Workers), written at the
// next heartbeat.
func (c *Client) Begin(j *Job) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.seq++
	c.work[j] = workEntry{tid: strconv.FormatUint(c.seq, 36), queue: j.Queue, payload: j.Raw, runAt: time.Now().Unix()}
}

// End records that the job stopped running; it counts as processed, and
// as failed too when failed is true (stat:processed, stat:failed and
// their daily keys, written at the next heartbeat).
func (c *Client) End(j *Job, failed bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.work, j)
	c.processed++
	if failed {
		c.failed++
	}
}

// Run runs the heartbeat, the scheduler and the recovery of dead
// processes' working lists until ctx ends; then it writes the last counts
// and takes the process out of "processes" (Sidekiq's clear_heartbeat).
// onSignal (may be nil) is called with each signal sent to the process
// through Sidekiq's API ("<identity>-signals"): TSTP makes the process
// quiet (Fetch hands out nothing more); TERM makes it quiet too, and the
// caller is expected to stop. onSignal runs on a goroutine of its own,
// one signal at a time in the order they came, so that it may take as
// long as it needs (stop the workers, cancel ctx, wait for Run to return)
// while the heartbeat goes on; Run does not wait for it, and a call may
// still be made after Run returned. A callback that never returns holds
// back the signals after it.
func (c *Client) Run(ctx context.Context, onSignal func(sig string)) error {
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		c.pollLoop(ctx)
	}()
	go func() {
		defer wg.Done()
		c.recoverLoop(ctx)
	}()
	var deliver func(string)
	if onSignal != nil {
		deliver = newSignalQueue(onSignal).add
	}
	t := time.NewTicker(c.cfg.Heartbeat)
	defer t.Stop()
	for {
		if err := c.beat(ctx, true, deliver); err != nil && ctx.Err() == nil {
			c.log.Error("sidekiq heartbeat failed", zap.Error(err))
		}
		select {
		case <-ctx.Done():
			wg.Wait()
			c.stop()
			return nil
		case <-t.C:
		}
	}
}

// signalQueue calls a callback with each signal added, in order, on a
// goroutine that runs while there are signals to deliver.
type signalQueue struct {
	mu      sync.Mutex
	fn      func(string)
	queue   []string
	running bool
}

func newSignalQueue(fn func(string)) *signalQueue { return &signalQueue{fn: fn} }

func (q *signalQueue) add(sig string) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.queue = append(q.queue, sig)
	if !q.running {
		q.running = true
		go q.drain()
	}
}

func (q *signalQueue) drain() {
	for {
		q.mu.Lock()
		if len(q.queue) == 0 {
			q.running = false
			q.mu.Unlock()
			return
		}
		sig := q.queue[0]
		q.queue = q.queue[1:]
		q.mu.Unlock()
		q.fn(sig)
	}
}

// stop flushes the counters and clears the heartbeat (best effort).
func (c *Client) stop() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := c.flushStats(ctx); err != nil {
		c.log.Warn("sidekiq: unable to flush stats", zap.Error(err))
	}
	_, err := c.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		p.SRem(ctx, keyProcesses, c.cfg.Identity)
		p.Unlink(ctx, c.cfg.Identity+":workers")
		return nil
	})
	if err != nil {
		c.log.Warn("sidekiq: unable to clear the heartbeat", zap.Error(err))
	}
}

// takeCounts returns and resets the counters.
func (c *Client) takeCounts() (procd, fails int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	procd, fails = c.processed, c.failed
	c.processed, c.failed = 0, 0
	return procd, fails
}

func (c *Client) giveBackCounts(procd, fails int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.processed += procd
	c.failed += fails
}

func statsCmds(ctx context.Context, p redis.Pipeliner, procd, fails int64) {
	nowdate := time.Now().UTC().Format(time.DateOnly)
	p.IncrBy(ctx, "stat:processed", procd)
	p.IncrBy(ctx, "stat:processed:"+nowdate, procd)
	p.Expire(ctx, "stat:processed:"+nowdate, statsTTL)
	p.IncrBy(ctx, "stat:failed", fails)
	p.IncrBy(ctx, "stat:failed:"+nowdate, fails)
	p.Expire(ctx, "stat:failed:"+nowdate, statsTTL)
}

func (c *Client) flushStats(ctx context.Context) error {
	procd, fails := c.takeCounts()
	if procd+fails == 0 {
		return nil
	}
	_, err := c.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		statsCmds(ctx, p, procd, fails)
		return nil
	})
	if err != nil {
		c.giveBackCounts(procd, fails)
	}
	return err
}

// beat is Sidekiq's heartbeat (launcher.rb ❤): the counters and the
// workers hash in one transaction; then the process entry, its hash
// (info, busy, beat, rtt_us, quiet, rss) and the next signal in another.
// New's first beat leaves signals for Run (signals false).
func (c *Client) beat(ctx context.Context, signals bool, onSignal func(string)) error {
	key := c.cfg.Identity
	workersKey := key + ":workers"
	ttl := c.cfg.HeartbeatTTL
	procd, fails := c.takeCounts()
	c.mu.Lock()
	busy := len(c.work)
	work := make(map[string]any, busy)
	for _, w := range c.work {
		work[w.tid] = mustJSON(map[string]any{"queue": w.queue, "payload": w.payload, "run_at": w.runAt})
	}
	c.mu.Unlock()
	_, err := c.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		statsCmds(ctx, p, procd, fails)
		p.Unlink(ctx, workersKey)
		if len(work) > 0 {
			p.HSet(ctx, workersKey, work)
		}
		p.Expire(ctx, workersKey, ttl)
		p.HSet(ctx, keyWorkingReg, key, c.queuesJS)
		return nil
	})
	if err != nil {
		c.giveBackCounts(procd, fails)
		return fmt.Errorf("heartbeat: %w", err)
	}
	start := time.Now()
	if err := c.rdb.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("heartbeat ping: %w", err)
	}
	rtt := time.Since(start).Microseconds()
	var sig *redis.StringCmd
	_, err = c.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		p.SAdd(ctx, keyProcesses, key)
		p.HSet(ctx, key, "info", c.infoJSON, "busy", busy, "beat", fmtFloat(nowFloat()),
			"rtt_us", rtt, "quiet", strconv.FormatBool(c.quiet.Load()), "rss", rssKB())
		p.Expire(ctx, key, ttl)
		if signals {
			sig = p.RPop(ctx, key+"-signals")
		}
		return nil
	})
	if err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("heartbeat: %w", err)
	}
	if sig == nil {
		return nil
	}
	if s, err := sig.Result(); err == nil && s != "" {
		c.signal(s, onSignal)
	}
	return nil
}

func (c *Client) signal(sig string, onSignal func(string)) {
	c.log.Info("sidekiq signal received", zap.String("signal", sig))
	switch sig {
	case "TSTP", "TERM":
		c.quiet.Store(true)
	}
	if onSignal != nil {
		onSignal(sig)
	}
}

// pollLoop is Sidekiq's scheduler poller: it moves due jobs of "retry" and
// "schedule" to their queues at random intervals averaging PollInterval
// (or 5 s times the number of processes).
func (c *Client) pollLoop(ctx context.Context) {
	for {
		if n, err := c.EnqueueDue(ctx); err != nil && ctx.Err() == nil {
			c.log.Error("sidekiq scheduler failed", zap.Error(err))
		} else if n > 0 {
			c.log.Debug("sidekiq scheduler enqueued jobs", zap.Int("jobs", n))
		}
		t := time.NewTimer(c.pollWait(ctx))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// pollWait is Sidekiq's random_poll_interval.
func (c *Client) pollWait(ctx context.Context) time.Duration {
	procs, err := c.rdb.SCard(ctx, keyProcesses).Result()
	if err != nil || procs < 1 {
		procs = 1
	}
	avg := c.cfg.PollInterval
	if avg <= 0 {
		avg = time.Duration(procs) * 5 * time.Second
	}
	if procs < 10 {
		return time.Duration(float64(avg)*rand.Float64()) + avg/2
	}
	return time.Duration(float64(avg) * rand.Float64())
}

// pushDueScript moves one due job from a sorted set to its queue, only
// when this caller removed it (ZREM returned 1), so that concurrent
// pollers never enqueue a job twice; the types of the keys it writes are
// checked first, so that it writes everything or nothing. KEYS: set,
// queue list (or the dead set), "queues"; ARGV: member, new payload,
// queue name, score ("" to push to the queue, else the payload goes to the
// dead set KEYS[2] with this score).
var pushDueScript = redis.NewScript(`
local function want(key, ty)
  local t = redis.call('TYPE', key).ok
  if t ~= 'none' and t ~= ty then
    return redis.error_reply('WRONGTYPE ' .. key .. ' is a ' .. t .. ', not a ' .. ty .. ': the job stays in ' .. KEYS[1])
  end
end
local bad
if ARGV[4] == '' then
  bad = want(KEYS[2], 'list') or want(KEYS[3], 'set')
else
  bad = want(KEYS[2], 'zset')
end
if bad then return bad end
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end
if ARGV[4] ~= '' then
  redis.call('ZADD', KEYS[2], ARGV[4], ARGV[2])
  return 1
end
redis.call('SADD', KEYS[3], ARGV[3])
redis.call('LPUSH', KEYS[2], ARGV[2])
return 1
`)

// EnqueueDue moves the jobs of "retry" and "schedule" whose time has come
// to their queues, one at a time as Sidekiq's Enq does, each as
// Sidekiq::Client.push would enqueue it (defaults "retry" true and
// "queue" "default" when absent, a jid and created_at when absent, a new
// enqueued_at). An entry that is not a JSON object goes to the dead set,
// wrapped as Kill wraps it when it is JSON. It returns the number of jobs
// moved. Run calls it periodically.
func (c *Client) EnqueueDue(ctx context.Context) (int, error) {
	moved := 0
	for _, set := range []string{keyRetry, keySchedule} {
		for ctx.Err() == nil {
			due, err := c.rdb.ZRangeArgs(ctx, redis.ZRangeArgs{
				Key: set, Start: "-inf", Stop: fmtFloat(nowFloat()), ByScore: true, Count: 1,
			}).Result()
			if err != nil {
				return moved, fmt.Errorf("sidekiq: read %s: %w", set, err)
			}
			if len(due) == 0 {
				break
			}
			member := due[0]
			keys, args := c.duePush(set, member)
			n, err := pushDueScript.Run(ctx, c.rdb, keys, args...).Int()
			if err != nil {
				return moved, fmt.Errorf("sidekiq: enqueue from %s: %w", set, err)
			}
			moved += n
		}
	}
	return moved, ctx.Err()
}

func (c *Client) duePush(set, member string) (keys []string, args []any) {
	msg, err := decodeObject(member)
	if err != nil {
		c.log.Error("sidekiq: an entry of "+set+" is not a JSON object: moved to the dead set", zap.Error(err))
		payload := member
		if json.Valid([]byte(member)) {
			payload = mustJSON(unreadable(member, "", "TypeError", "an entry of "+set+" is not a job hash: "+err.Error()))
		}
		return []string{set, keyDead, keyQueues}, []any{member, payload, "", fmtFloat(nowFloat())}
	}
	now := nowFloat()
	if _, ok := msg["retry"]; !ok {
		msg["retry"] = true
	}
	q, _ := msg["queue"].(string)
	if q == "" {
		q = "default"
	}
	msg["queue"] = q
	if s, _ := msg["jid"].(string); s == "" {
		msg["jid"] = newJID()
	}
	if _, ok := msg["created_at"]; !ok {
		msg["created_at"] = now
	}
	delete(msg, "at")
	msg["enqueued_at"] = now
	return []string{set, queueKey(q), keyQueues}, []any{member, mustJSON(msg), q, ""}
}

// recoverScript moves a dead process's working lists back to their
// queues, oldest job fetched first, unless its heartbeat key came back,
// and ends the process's epoch: a job fetched before cannot be settled
// any more (settleScript compares the epoch Fetch saw), and the next
// fetch starts a new one. It checks the types of all keys first, so that
// it moves everything or nothing. KEYS: heartbeat key, registry, epochs,
// "queues", then working list and queue pairs; ARGV[1] identity, ARGV[2]
// "own" for this process's own lists (no heartbeat check, stays
// registered), then the queue names.
var recoverScript = redis.NewScript(`
local own = ARGV[2] == 'own'
if not own and redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
local function want(key, ty)
  local t = redis.call('TYPE', key).ok
  if t ~= 'none' and t ~= ty then
    return redis.error_reply('WRONGTYPE ' .. key .. ' is a ' .. t .. ', not a ' .. ty .. ': nothing recovered')
  end
end
local bad
for i = 5, #KEYS, 2 do
  bad = bad or want(KEYS[i], 'list')
  if not bad and redis.call('EXISTS', KEYS[i]) == 1 then
    bad = want(KEYS[i+1], 'list') or want(KEYS[4], 'set')
  end
end
if bad then return bad end
redis.call('HDEL', KEYS[3], ARGV[1])
local moved = 0
for i = 5, #KEYS, 2 do
  local n = 0
  while redis.call('LMOVE', KEYS[i], KEYS[i+1], 'LEFT', 'RIGHT') do n = n + 1 end
  if n > 0 then redis.call('SADD', KEYS[4], ARGV[3 + (i - 5) / 2]) end
  moved = moved + n
end
if not own then redis.call('HDEL', KEYS[2], ARGV[1]) end
return moved
`)

func (c *Client) recover(ctx context.Context, identity string, queues []string, mode string) (int, error) {
	keys := []string{identity, keyWorkingReg, keyEpoch, keyQueues}
	args := []any{identity, mode}
	for _, q := range queues {
		keys = append(keys, WorkingKey(identity, q), queueKey(q))
		args = append(args, q)
	}
	return recoverScript.Run(ctx, c.rdb, keys, args...).Int()
}

// RequeueAll moves every job of this process's working lists back to the
// head of its queue (oldest fetched first), as Sidekiq's bulk_requeue does
// at shutdown, and returns how many it moved: for a worker that stops
// without finishing the jobs it holds. Settling one of them afterwards
// returns ErrNotHeld, also when the same job was fetched again since.
func (c *Client) RequeueAll(ctx context.Context) (int, error) {
	n, err := c.recover(ctx, c.cfg.Identity, c.uniq, "own")
	if err != nil {
		return 0, fmt.Errorf("sidekiq: requeue the working lists: %w", err)
	}
	if n > 0 {
		c.log.Info("sidekiq: unfinished jobs requeued", zap.Int("jobs", n))
	}
	return n, nil
}

// requeueLeftovers is New's RequeueAll of the lists of a previous run
// with the same identity (a fixed Config.Identity), for the queues it
// registered as well as this run's.
func (c *Client) requeueLeftovers(ctx context.Context) error {
	queues := c.uniq
	prev, err := c.rdb.HGet(ctx, keyWorkingReg, c.cfg.Identity).Result()
	switch {
	case errors.Is(err, redis.Nil):
	case err != nil:
		return fmt.Errorf("sidekiq: read %s: %w", keyWorkingReg, err)
	default:
		var old []string
		if err := json.Unmarshal([]byte(prev), &old); err != nil {
			c.log.Error("sidekiq: unreadable working list registration", zap.String("owner", c.cfg.Identity), zap.Error(err))
		}
		queues = uniq(append(append([]string(nil), queues...), old...))
	}
	n, err := c.recover(ctx, c.cfg.Identity, queues, "own")
	if err != nil {
		return fmt.Errorf("sidekiq: requeue the jobs left by a previous run of %s: %w", c.cfg.Identity, err)
	}
	if n > 0 {
		c.log.Warn("sidekiq: jobs left by a previous run of this identity requeued", zap.Int("jobs", n))
	}
	return nil
}

func (c *Client) recoverLoop(ctx context.Context) {
	t := time.NewTicker(c.cfg.RecoverInterval)
	defer t.Stop()
	for {
		if _, err := c.RecoverDead(ctx); err != nil && ctx.Err() == nil {
			c.log.Error("sidekiq recovery failed", zap.Error(err))
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// RecoverDead moves the jobs in the working lists of processes whose
// heartbeat key has expired back to their queues and returns how many it
// moved. Run calls it at start and every RecoverInterval.
func (c *Client) RecoverDead(ctx context.Context) (int, error) {
	reg, err := c.rdb.HGetAll(ctx, keyWorkingReg).Result()
	if err != nil {
		return 0, fmt.Errorf("sidekiq: read %s: %w", keyWorkingReg, err)
	}
	total := 0
	for identity, qs := range reg {
		if identity == c.cfg.Identity {
			continue
		}
		var queues []string
		if err := json.Unmarshal([]byte(qs), &queues); err != nil {
			c.log.Error("sidekiq: unreadable working list registration", zap.String("owner", identity), zap.Error(err))
			continue
		}
		n, err := c.recover(ctx, identity, queues, "dead")
		if err != nil {
			return total, fmt.Errorf("sidekiq: recover the jobs of %s: %w", identity, err)
		}
		if n > 0 {
			c.log.Warn("sidekiq: jobs of a dead process recovered to their queues",
				zap.String("owner", identity), zap.Int("jobs", n))
			total += n
		}
	}
	return total, nil
}

func newJID() string {
	const hexd = "0123456789abcdef"
	b := make([]byte, 24)
	for i := range b {
		b[i] = hexd[rand.IntN(16)]
	}
	return string(b)
}

func hostname() string {
	if h := os.Getenv("DYNO"); h != "" {
		return h
	}
	h, _ := os.Hostname()
	return h
}

func pid() int { return os.Getpid() }

// rssKB is the resident set size in KiB (VmRSS of /proc/self/status), 0
// where unknown.
func rssKB() int64 {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0
	}
	defer func() { _ = f.Close() }()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if rest, ok := strings.CutPrefix(s.Text(), "VmRSS:"); ok {
			fields := strings.Fields(rest)
			if len(fields) > 0 {
				n, _ := strconv.ParseInt(fields[0], 10, 64)
				return n
			}
		}
	}
	return 0
}
