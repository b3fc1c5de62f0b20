package tasks

import (
	"math/rand/v2"
	"time"

	"github.com/onceler/onceler/celeryproto"
)

// Call describes the delivery a task is running for.
type Call struct {
	// TaskID is the Celery task id of this delivery.
	TaskID string
	// Key is the operation key (from Task.Key or the idempotency_key header);
	// empty for pure tasks.
	Key string
	// Reference is what an outside-mode task passes to the outside system so
	// that it can recognise a repeat of the operation: the task name and the
	// operation key.
	Reference string
	// Retries is the Celery retry count of this delivery.
	Retries int
	// Attempt is the record's attempt number for this operation (1 for the
	// first claim); 0 without a record.
	Attempt int
	// Message is the decoded Celery message. Treat it as read-only.
	Message *celeryproto.Message
	// Node is the worker's node name.
	Node string

	retry RetryPolicy
}

// Retry returns a request to run the task again after countdown, as
// Celery's self.retry; 0 means the task's RetryPolicy: its backoff when
// Backoff is set, else its Countdown (default 180 s). cause is what the
// caller sees if the retries are used up (nil: MaxRetriesExceededError).
// Return it from Run:
//
//	return nil, c.Retry(10*time.Second, err)
func (c *Call) Retry(countdown time.Duration, cause error) error {
	if countdown <= 0 {
		countdown = c.retry.delay(c.Retries, rand.Int64N)
	}
	return &RetryRequest{Countdown: countdown, Cause: cause}
}

// reference builds Call.Reference.
func reference(task, key string) string { return task + ":" + key }
