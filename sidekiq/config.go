package sidekiq

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/onceler/onceler/internal/redact"
)

// Config configures a Client. Only URL and Queues are required.
type Config struct {
	// URL is the Redis of Sidekiq: redis://[[user]:password@]host[:port][/db]
	// or rediss:// (TLS).
	URL string
	// Queues are the queues to fetch from, as Sidekiq's -q options: "name"
	// or "name,weight". Without weights the queues are taken in strict
	// order (the first with a job wins); when any queue has a weight, each
	// fetch tries them in a random order in which a queue of weight w is
	// w times as likely to come first (Sidekiq's BasicFetch).
	Queues []string
	// Identity names this process in Sidekiq's "processes" set; default
	// hostname:pid:<12 hex digits>, as Sidekiq makes it ($DYNO, when set,
	// instead of the host name).
	Identity string
	// Concurrency is the number of jobs run at once, shown in the
	// heartbeat (default 10, Sidekiq's).
	Concurrency int
	// Tag and Labels are shown in the heartbeat.
	Tag    string
	Labels []string
	// Logger receives the client's logs (default: none).
	Logger *zap.Logger

	// FetchTimeout is how long one blocking fetch of a single queue waits
	// (BLMOVE's timeout) before Fetch looks at its context and state again
	// (default 2 s, Sidekiq's BasicFetch::TIMEOUT).
	FetchTimeout time.Duration
	// FetchPoll is, with several queues, how long Fetch blocks on the queue
	// first in order before it looks at all of them again (default 1 s): a
	// job arriving on another queue waits at most this long. Both timeouts
	// are counted in whole seconds, at least one.
	FetchPoll time.Duration
	// Heartbeat is the interval of the heartbeat (default 5 s, Sidekiq's
	// BEAT_PAUSE); HeartbeatTTL is how long the heartbeat keys live
	// (default 60 s, Sidekiq's): after that the process counts as dead and
	// its working lists are recovered.
	Heartbeat    time.Duration
	HeartbeatTTL time.Duration
	// PollInterval is the average interval of the scheduler that moves due
	// jobs of the "schedule" and "retry" sets to their queues; default:
	// 5 s times the number of processes, as Sidekiq scales it.
	PollInterval time.Duration
	// RecoverInterval is how often the working lists of dead processes are
	// looked for (default 30 s, and once when Run starts).
	RecoverInterval time.Duration
	// MaxRetries is the number of retries of a job whose "retry" is true
	// (default 25, Sidekiq's).
	MaxRetries int
	// DeadMaxJobs and DeadTimeout bound the dead set (default 10000 jobs
	// and 180 days, Sidekiq's dead_max_jobs and dead_timeout_in_seconds).
	DeadMaxJobs int
	DeadTimeout time.Duration
}

func (cfg *Config) defaults() error {
	if cfg.URL == "" {
		return fmt.Errorf("sidekiq: no Redis URL")
	}
	if cfg.Identity == "" {
		cfg.Identity = defaultIdentity()
	}
	if cfg.Concurrency <= 0 {
		cfg.Concurrency = 10
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	if cfg.Labels == nil {
		cfg.Labels = []string{}
	}
	setDur := func(d *time.Duration, def time.Duration) {
		if *d <= 0 {
			*d = def
		}
	}
	setDur(&cfg.FetchTimeout, 2*time.Second)
	setDur(&cfg.FetchPoll, time.Second)
	cfg.FetchTimeout = max(cfg.FetchTimeout.Truncate(time.Second), time.Second)
	cfg.FetchPoll = max(cfg.FetchPoll.Truncate(time.Second), time.Second)
	setDur(&cfg.Heartbeat, 5*time.Second)
	setDur(&cfg.HeartbeatTTL, 60*time.Second)
	setDur(&cfg.RecoverInterval, 30*time.Second)
	setDur(&cfg.DeadTimeout, 180*24*time.Hour)
	if cfg.HeartbeatTTL < time.Second || cfg.HeartbeatTTL < 2*cfg.Heartbeat {
		return fmt.Errorf("sidekiq: HeartbeatTTL %v must be at least 1 s and twice Heartbeat (%v), or a live process is taken for dead", cfg.HeartbeatTTL, cfg.Heartbeat)
	}
	if cfg.MaxRetries <= 0 {
		cfg.MaxRetries = 25
	}
	if cfg.DeadMaxJobs <= 0 {
		cfg.DeadMaxJobs = 10000
	}
	return nil
}

func defaultIdentity() string {
	host := os.Getenv("DYNO")
	if host == "" {
		host, _ = os.Hostname()
	}
	var b [6]byte
	_, _ = rand.Read(b[:])
	return host + ":" + strconv.Itoa(os.Getpid()) + ":" + hex.EncodeToString(b[:])
}

// parseQueues reads Sidekiq's -q list: each "name" or "name,weight" is
// added max(weight, 1) times; the order is strict unless a weight is
// given (cli.rb parse_queue).
// MaxQueueWeight is the largest weight of a queue in Config.Queues.
const MaxQueueWeight = 1000

func parseQueues(specs []string) (expanded []string, strict bool, err error) {
	if len(specs) == 0 {
		return nil, false, fmt.Errorf("sidekiq: no queues")
	}
	strict = true
	seen := map[string]bool{}
	for _, spec := range specs {
		name, weight, hasWeight := strings.Cut(spec, ",")
		name = strings.TrimSpace(name)
		if name == "" {
			return nil, false, fmt.Errorf("sidekiq: empty queue name in %q", spec)
		}
		if seen[name] {
			return nil, false, fmt.Errorf("sidekiq: queue %q cannot be defined twice", name)
		}
		seen[name] = true
		w := 0
		if hasWeight {
			w, err = strconv.Atoi(strings.TrimSpace(weight))
			if err != nil {
				return nil, false, fmt.Errorf("sidekiq: queue weight in %q: %w", spec, err)
			}
			if w < 0 || w > MaxQueueWeight {
				// The order is drawn from the queue repeated weight times.
				return nil, false, fmt.Errorf("sidekiq: queue weight in %q: not between 0 and %d", spec, MaxQueueWeight)
			}
		}
		for range max(w, 1) {
			expanded = append(expanded, name)
		}
		if w > 0 {
			strict = false
		}
	}
	return expanded, strict, nil
}

func uniq(s []string) []string {
	seen := map[string]bool{}
	var out []string
	for _, v := range s {
		if !seen[v] {
			seen[v] = true
			out = append(out, v)
		}
	}
	return out
}

// RedactURL returns raw with its password hidden, for logs.
func RedactURL(raw string) string { return redact.URL(raw) }
