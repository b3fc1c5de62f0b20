package sidekiq

import (
	"context"
	"errors"
	"fmt"
	"net/url"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
)

// Producer pushes jobs as they are (a job kept elsewhere, pushed again)
// to Sidekiq's queues, as Sidekiq::Client.push does for an immediate job:
// the queue added to "queues", the job to the head of "queue:<name>".
type Producer struct {
	url string
	rdb *redis.Client
}

// NewProducer returns a Producer for the Redis at rawURL (see Config.URL).
// It connects at its first call.
func NewProducer(rawURL string) (*Producer, error) {
	opt, err := redis.ParseURL(rawURL)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err // its message would repeat the URL, password included
		}
		return nil, fmt.Errorf("sidekiq: Redis URL %s: %w", RedactURL(rawURL), err)
	}
	opt.DisableIdentity = true
	opt.MaintNotificationsConfig = &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
	return &Producer{url: rawURL, rdb: redis.NewClient(opt)}, nil
}

// Ping checks that Redis answers.
func (p *Producer) Ping(ctx context.Context) error {
	if err := p.rdb.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("sidekiq: Redis at %s: %w", RedactURL(p.url), err)
	}
	return nil
}

// PushRaw pushes job, a job hash in JSON exactly as it is to be stored, to
// queue.
func (p *Producer) PushRaw(ctx context.Context, queue, job string) error {
	if queue == "" {
		return errors.New("sidekiq: push: no queue")
	}
	_, err := p.rdb.TxPipelined(ctx, func(pl redis.Pipeliner) error {
		pl.SAdd(ctx, keyQueues, queue)
		pl.LPush(ctx, queueKey(queue), job)
		return nil
	})
	if err != nil {
		return fmt.Errorf("sidekiq: push to %s: %w", queue, err)
	}
	return nil
}

// Close closes the connections.
func (p *Producer) Close() error { return p.rdb.Close() }
