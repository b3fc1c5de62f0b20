package sidekiq

import (
	"context"
	"errors"
	"fmt"

	"github.com/redis/go-redis/v9"
)

// Held reports, for each job, whether this process still holds it: the
// process's epoch is the one Fetch saw when it took the job. A recovery of
// the process's working lists (by another process that took it for dead,
// or by RequeueAll) ends the epoch, so every job fetched before reads
// false; settling one of them returns ErrNotHeld. A Job not made by Fetch
// reads true (only a settle can tell). One Redis read for all the jobs.
func (c *Client) Held(ctx context.Context, jobs []*Job) ([]bool, error) {
	epoch, err := c.rdb.HGet(ctx, keyEpoch, c.cfg.Identity).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("sidekiq: read the epoch of %s: %w", c.cfg.Identity, err)
	}
	held := make([]bool, len(jobs))
	for i, j := range jobs {
		held[i] = j != nil && (j.epoch == "" || j.epoch == epoch)
	}
	return held, nil
}
