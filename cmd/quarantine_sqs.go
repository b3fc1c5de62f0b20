package cmd

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/onceler/onceler/sqs"
	"github.com/onceler/onceler/tasks"
)

// sqsQuarantine is the quarantine command's --sqs: the quarantine queue of
// each consumed SQS queue (its redrive policy's dead-letter queue, else
// "<queue>-quarantine"), read by receiving its messages (hidden while the
// command looks at them, visible again after unless requeued or dropped).
type sqsQuarantine struct {
	endpoint string
	client   *sqs.Client
}

// describeSQS is what the quarantine command shows of a quarantined SQS
// message.
func describeSQS(m sqs.Message, fallbackQueue string) quarantined {
	a := m.Attributes
	q := quarantined{TaskID: a["task_id"], Task: a["task"], Reason: a[tasks.HeaderReason], Detail: a[tasks.HeaderDetail],
		Queue: a[tasks.HeaderQueue], QuarantinedAt: a[tasks.HeaderTime], ContentType: "application/json", Bytes: len(m.Body)}
	if k, err := sqs.DecodeKombu(m.Body); err == nil {
		if id, ok := k.Delivery.Headers["id"].(string); ok {
			q.TaskID = id
		}
		if t, ok := k.Delivery.Headers["task"].(string); ok {
			q.Task = t
		}
		q.ContentType = k.Delivery.ContentType
	}
	if q.TaskID == "" {
		q.TaskID = m.ID
	}
	if q.Queue == "" {
		q.Queue = fallbackQueue
	}
	return q
}

// runSQS acts on the quarantine of the SQS queue q.queue.
func (q *quarantine) runSQS(ctx context.Context, action string) ([]quarantined, error) {
	c := q.sqs.client
	info, err := c.Info(ctx, q.queue, false)
	if err != nil {
		return nil, fmt.Errorf("quarantine: %w", err)
	}
	q.qname = info.DeadLetter
	if q.qname == "" {
		q.qname = sqsQuarantineName(q.queue)
	}
	qurl, err := c.QueueURL(ctx, q.qname)
	if sqs.NotFound(err) {
		if !q.asJSON || action != "list" {
			fmt.Fprintf(q.a.stdout, "no queue %s: nothing was ever quarantined from %s\n", q.qname, q.queue)
		}
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("quarantine: %w", err)
	}
	var listed []quarantined
	var keep []sqs.Visibility
	defer func() {
		// What was looked at and kept is visible again at once.
		if len(keep) > 0 {
			kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			_ = c.SetVisibility(kctx, keep)
			cancel()
		}
	}()
	seen, moved := 0, 0
	for q.limit == 0 || seen < q.limit {
		n := sqs.MaxBatch
		if q.limit > 0 {
			n = min(n, q.limit-seen)
		}
		msgs, err := c.Receive(ctx, q.qname, n, 0, 5*time.Minute)
		if err != nil {
			return nil, fmt.Errorf("quarantine: %w", err)
		}
		if len(msgs) == 0 {
			break
		}
		for _, m := range msgs {
			seen++
			d := describeSQS(m, q.queue)
			match := q.reason == "" || d.Reason == q.reason
			switch {
			case !match:
			case action == "list":
				listed = append(listed, d)
			case q.all || q.ids[d.TaskID]:
				if action == "requeue" {
					if err := requeueSQS(ctx, c, m, d.Queue); err != nil {
						keep = append(keep, sqs.Visibility{QueueURL: qurl, ReceiptHandle: m.ReceiptHandle})
						return nil, fmt.Errorf("%s stopped after %d message(s): %s", action, moved, oneLine(err))
					}
				}
				if err := c.Delete(ctx, qurl, m.ReceiptHandle); err != nil {
					return nil, fmt.Errorf("%s stopped after %d message(s): %s", action, moved, oneLine(err))
				}
				moved++
				delete(q.ids, d.TaskID)
				fmt.Fprintf(q.a.stdout, "%s %s (%s, %s)\n", pastTense(action), dash(d.TaskID), dash(d.Task), dash(d.Reason))
				continue
			}
			keep = append(keep, sqs.Visibility{QueueURL: qurl, ReceiptHandle: m.ReceiptHandle})
		}
	}
	return q.report(action, listed, seen, moved)
}

// sqsQuarantineName is the quarantine queue of an SQS queue without a
// dead-letter queue (as the worker names it).
func sqsQuarantineName(queue string) string {
	if base, ok := strings.CutSuffix(queue, ".fifo"); ok {
		return base + "-quarantine.fifo"
	}
	return queue + "-quarantine"
}

// requeueSQS sends a quarantined message back to the queue it came from,
// its body as it is, without the quarantine attributes.
func requeueSQS(ctx context.Context, c *sqs.Client, m sqs.Message, queue string) error {
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	u, err := c.QueueURL(wctx, queue)
	if err != nil {
		return err
	}
	out := sqs.Outgoing{Body: m.Body, Attributes: map[string]string{}, AttributeTypes: map[string]string{}, GroupID: m.GroupID}
	for k, v := range m.Attributes {
		if !strings.HasPrefix(k, "x-onceler-") {
			out.Attributes[k] = v
			out.AttributeTypes[k] = m.AttributeTypes[k]
		}
	}
	if _, err := c.Send(wctx, u, out); err != nil {
		return fmt.Errorf("send back to %s: %w", queue, err)
	}
	return nil
}
