package sidekiq

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// keyDeliveriesPrefix is the prefix of the per-job delivery counters:
// "onceler:deliveries:<jid>".
const keyDeliveriesPrefix = "onceler:deliveries:"

// deliveriesTTL bounds how long a counter of a job that was never settled
// (deleted from its queue by hand, say) is kept.
const deliveriesTTL = 7 * 24 * time.Hour

// CountDelivery counts one more fetch of the job (by its jid) and returns
// how many fetches of it the counter holds, this one included: 1 for a
// job fetched for the first time, more for one handed out again (recovered
// from a dead process's working list, requeued by a stopping worker after
// its run began): a run of it may have begun before. A fetch whose job is
// handed back without a run of it begun is taken off the count
// (UncountDeliveries). The count is kept until ForgetDeliveries
// (the job settled for good) or for 7 days. A job without a jid counts 1.
// Two jobs pushed with the same jid share one counter.
func (c *Client) CountDelivery(ctx context.Context, j *Job) (int, error) {
	if j == nil || j.JID == "" {
		return 1, nil
	}
	key := keyDeliveriesPrefix + j.JID
	p := c.rdb.TxPipeline()
	n := p.Incr(ctx, key)
	p.Expire(ctx, key, deliveriesTTL)
	if _, err := p.Exec(ctx); err != nil {
		return 1, fmt.Errorf("sidekiq: count the deliveries of %s: %w", j.JID, err)
	}
	return int(n.Val()), nil
}

// ForgetDeliveries removes the job's delivery counter: it was settled for
// good (done, retried, scheduled or dead), and a retry of it is a new
// delivery.
func (c *Client) ForgetDeliveries(ctx context.Context, j *Job) error {
	if j == nil || j.JID == "" {
		return nil
	}
	if err := c.rdb.Del(ctx, keyDeliveriesPrefix+j.JID).Err(); err != nil {
		return fmt.Errorf("sidekiq: forget the deliveries of %s: %w", j.JID, err)
	}
	return nil
}

// uncountScript takes one fetch off each counter (KEYS), deleting a
// counter that falls to 0 or below (one that had expired, or was removed
// by a settle since). It checks all the counters first, so that it lowers
// all of them or none.
var uncountScript = redis.NewScript(`
for i = 1, #KEYS do
  local t = redis.call('TYPE', KEYS[i]).ok
  if t ~= 'none' and (t ~= 'string' or not string.match(redis.call('GET', KEYS[i]), '^%-?%d+$')) then
    return redis.error_reply('delivery counter ' .. KEYS[i] .. ' is not an integer: nothing uncounted')
  end
end
for i = 1, #KEYS do
  if redis.call('DECR', KEYS[i]) <= 0 then redis.call('DEL', KEYS[i]) end
end
return #KEYS
`)

// UncountDeliveries takes the fetch of each job (by its jid) off its
// delivery counter, in one atomic step: the jobs are handed back to their
// queues (Requeue, RequeueAll) without a run of them begun, so that
// fetch is no delivery the poison limit should count. A counter that
// falls to 0 is removed. Call it once per counted fetch of a job, only
// for a job whose run did not begin: one whose run began, or a job
// recovered from a dead process, keeps its count. Jobs without a jid are
// skipped.
func (c *Client) UncountDeliveries(ctx context.Context, jobs ...*Job) error {
	keys := make([]string, 0, len(jobs))
	for _, j := range jobs {
		if j != nil && j.JID != "" {
			keys = append(keys, keyDeliveriesPrefix+j.JID)
		}
	}
	if len(keys) == 0 {
		return nil
	}
	if err := uncountScript.Run(ctx, c.rdb, keys).Err(); err != nil {
		return fmt.Errorf("sidekiq: uncount the deliveries of %d jobs: %w", len(keys), err)
	}
	return nil
}
