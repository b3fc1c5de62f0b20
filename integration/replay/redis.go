package replay

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceler/onceler/internal/testkit"
	"github.com/onceler/onceler/tasks"
)

// redisClient is the client of Config.ResultBackend, opened on first use
// and closed when the test ends.
func (e *Env) redisClient() *redis.Client {
	e.redisOnce.Do(func() {
		opt, err := redis.ParseURL(e.cfg.ResultBackend)
		if err != nil {
			e.t.Fatalf("result backend %s: %v", tasks.RedactResultBackend(e.cfg.ResultBackend), err)
		}
		opt.DisableIdentity = true
		e.redis = redis.NewClient(opt)
		e.t.Cleanup(func() { _ = e.redis.Close() })
	})
	return e.redis
}

// storedReplies is the result stored in Redis for task id (Celery's
// celery-task-meta-<id>), or none.
func (e *Env) storedReplies(id string) []Reply {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	b, err := e.redisClient().Get(ctx, tasks.TaskKeyPrefix+id).Bytes()
	if err != nil {
		return nil
	}
	var meta struct {
		TaskID string          `json:"task_id"`
		Status string          `json:"status"`
		Result json.RawMessage `json:"result"`
	}
	r := Reply{TaskID: id}
	if err := json.Unmarshal(b, &meta); err != nil {
		r.Status = "UNDECODABLE"
		return []Reply{r}
	}
	r.Status, r.Result = meta.Status, meta.Result
	if meta.TaskID != id {
		r.Status = "MISMATCHED_ID"
	}
	var exc struct {
		Type string `json:"exc_type"`
	}
	if r.Status != "SUCCESS" && json.Unmarshal(meta.Result, &exc) == nil {
		r.ExcType = exc.Type
	}
	return []Reply{r}
}

// ready reports whether a result is final (Celery's READY_STATES).
func (r Reply) ready() bool {
	return r.Status == "SUCCESS" || r.Status == "FAILURE" || r.Status == "REVOKED"
}

// waitStored waits until every id has a final result in Redis and the
// queue is settled: the copies of a message delivered several times share
// one key, so the first copy's result does not say the others were handled.
func (e *Env) waitStored(ids []string, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	stored := testkit.Eventually(timeout, func() bool {
		for _, id := range ids {
			reps := e.storedReplies(id)
			if len(reps) == 0 || !reps[0].ready() {
				return false
			}
		}
		return true
	})
	return stored && testkit.Eventually(time.Until(deadline), e.queueSettled)
}

// queueSettled reports whether the queue holds no message: none ready and,
// where rabbitmqctl can tell (the local broker, as root), none delivered
// and unacknowledged either.
func (e *Env) queueSettled() bool {
	if n, err := e.QueueDepth(e.Queue); err != nil || n != 0 {
		return false
	}
	if os.Geteuid() != 0 {
		return true
	}
	out, err := exec.Command("rabbitmqctl", "-q", "list_queues", "name", "messages").Output()
	if err != nil {
		return true
	}
	for _, line := range strings.Split(string(out), "\n") {
		if f := strings.Fields(line); len(f) == 2 && f[0] == e.Queue {
			return f[1] == "0"
		}
	}
	return true
}

// repliesPer is how many results a caller of a task id delivered n times
// gets: n on the reply queue, one in Redis (a key per task id).
func (e *Env) repliesPer(n int) int {
	if e.cfg.ResultBackend != "" {
		return min(n, 1)
	}
	return n
}

// answeredAgain waits, with a Redis result backend, until the result of
// id is SUCCESS (a replayed held message replaces its FAILURE
// OperationHeld); with the reply queue a new reply is counted instead.
func (e *Env) answeredAgain(id string, timeout time.Duration) bool {
	if e.cfg.ResultBackend == "" {
		return true
	}
	return testkit.Eventually(timeout, func() bool {
		reps := e.storedReplies(id)
		return len(reps) == 1 && reps[0].Status == "SUCCESS"
	})
}
