package sidekiq

import (
	"context"
	"fmt"
	"time"
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
// from a dead process's working list, requeued by a stopping worker): a
// run of it may have begun before. The count is kept until ForgetDeliveries
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
