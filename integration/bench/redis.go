package main

import (
	"context"
	"fmt"

	"github.com/redis/go-redis/v9"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/tasks"
)

// verifyRedis checks that every message of a (c-redis) run has its result
// in Redis (celery-task-meta-<task id>), then deletes them.
func verifyRedis(ctx context.Context, url string, msgs []*celeryproto.Publishing) error {
	opt, err := redis.ParseURL(url)
	if err != nil {
		return fmt.Errorf("-redis %s: %w", tasks.RedactResultBackend(url), err)
	}
	opt.DisableIdentity = true
	c := redis.NewClient(opt)
	defer func() { _ = c.Close() }()
	ids := make(map[string]bool, len(msgs))
	for _, m := range msgs {
		if id, _ := m.Headers["id"].(string); id != "" {
			ids[id] = true
		}
	}
	keys := make([]string, 0, len(ids))
	for id := range ids {
		keys = append(keys, tasks.TaskKeyPrefix+id)
	}
	var found int64
	for len(keys) > 0 {
		batch := keys[:min(len(keys), 1000)]
		keys = keys[len(batch):]
		n, err := c.Exists(ctx, batch...).Result()
		if err != nil {
			return fmt.Errorf("count results in Redis: %w", err)
		}
		found += n
		if err := c.Del(ctx, batch...).Err(); err != nil {
			return fmt.Errorf("delete results in Redis: %w", err)
		}
	}
	if found != int64(len(ids)) {
		return fmt.Errorf("%d results in Redis, want %d", found, len(ids))
	}
	return nil
}
