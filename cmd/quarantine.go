package cmd

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/sqs"
	"github.com/onceler/onceler/tasks"
)

func quarantineCommand() *command {
	return &command{
		name:    "quarantine",
		args:    "list|requeue|drop [TASK_ID...]",
		summary: "list, requeue or drop quarantined messages, with their reasons",
		long: `A worker moves aside, to the queue <queue>.quarantine, each message it must
not run and must not drop: undecodable (or pickle), unknown task, bad
arguments, a workflow it does not support (unsupported_workflow), arguments
that differ from the record's for the same operation key
(fingerprint_mismatch), or delivered too often (poison). Each carries the
headers x-onceler-reason, x-onceler-detail, x-onceler-queue and
x-onceler-quarantined-at.

  list                 show the quarantined messages (they stay queued)
  requeue TASK_ID...   move those messages back to the queue they came from
                       (after fixing the cause, e.g. deploying the task)
  drop TASK_ID...      delete those messages for good

requeue and drop take task ids, or --all; --reason narrows to one reason.

With --sqs it works on the quarantine queues of SQS queues: each queue's
redrive dead-letter queue, else <queue>-quarantine; the reasons are message
attributes of the same names (docs/sqs.md).`,
		setup: func(a *app, fs *flagSet) func(context.Context, []string) error {
			var (
				b      brokerFlags
				queues string
				reason string
				all    bool
				limit  int
				asJSON bool
				useSQS bool
				sqsEP  string
			)
			b.define(fs)
			fs.String(&queues, "queues", "LIST", "celery", "comma-separated consumed queues whose quarantines (<queue>.quarantine) to use, as the worker's --queues")
			fs.Alias("queue", "queues")
			fs.String(&reason, "reason", "REASON", "", "only messages quarantined for this reason: "+strings.Join(tasks.Reasons, ", "))
			fs.Bool(&all, "all", "requeue or drop every message (that matches --reason)")
			fs.CommandLineOnly("all")
			fs.Int(&limit, "limit", 0, "look at most at this many messages; 0: all")
			fs.Bool(&asJSON, "json", "list: print JSON")
			fs.Bool(&useSQS, "sqs", "the quarantines of Amazon SQS queues (the AWS SDK's configuration, as the worker's --sqs)")
			fs.String(&sqsEP, "sqs-endpoint", "URL", "", "with --sqs, the SQS endpoint instead of the AWS SDK's")
			return func(ctx context.Context, args []string) error {
				if len(args) == 0 {
					return usagef("quarantine", "want an action: list, requeue or drop")
				}
				action, ids := args[0], args[1:]
				switch action {
				case "list":
					if len(ids) > 0 {
						return usagef("quarantine", "list takes no task ids")
					}
				case "requeue", "drop":
					if len(ids) == 0 && !all {
						if env, set := fs.ignoredEnv(a.getenv, "all"); set {
							return usagef("quarantine", "%s needs task ids or --all on the command line (%s is ignored: --all is never taken from the environment)", action, env)
						}
						return usagef("quarantine", "%s needs task ids or --all", action)
					}
					if len(ids) > 0 && all {
						return usagef("quarantine", "give task ids or --all, not both")
					}
				default:
					return usagef("quarantine", "unknown action %q: use list, requeue or drop", action)
				}
				var names []string
				for _, n := range strings.Split(queues, ",") {
					if n = strings.TrimSpace(n); n != "" {
						names = append(names, n)
					}
				}
				if len(names) == 0 {
					return usagef("quarantine", "--queues names no queue")
				}
				if limit < 0 {
					return usagef("quarantine", "--limit must not be negative")
				}
				if reason != "" && !slices.Contains(tasks.Reasons, reason) {
					return usagef("quarantine", "unknown --reason %q: use %s", reason, strings.Join(tasks.Reasons, ", "))
				}
				q := &quarantine{a: a, b: b, reason: reason, ids: map[string]bool{}, all: all, limit: limit, asJSON: asJSON}
				for _, id := range ids {
					q.ids[id] = true
				}
				if useSQS {
					c, err := sqs.New(ctx, sqs.Config{Endpoint: sqsEP})
					if err != nil {
						return err
					}
					defer func() { _ = c.Close() }()
					q.sqs = &sqsQuarantine{endpoint: sqsEP, client: c}
				}
				return q.runAll(ctx, action, names)
			}
		},
	}
}

type quarantine struct {
	a            *app
	b            brokerFlags
	queue, qname string
	reason       string
	ids          map[string]bool
	all          bool
	limit        int
	asJSON       bool
	// sqs, when set: SQS queues (--sqs).
	sqs *sqsQuarantine
}

// quarantined is one message as listed.
type quarantined struct {
	TaskID        string `json:"task_id"`
	Task          string `json:"task"`
	Reason        string `json:"reason"`
	Detail        string `json:"detail"`
	Queue         string `json:"queue"`
	QuarantinedAt string `json:"quarantined_at"`
	ContentType   string `json:"content_type"`
	Bytes         int    `json:"bytes"`
}

func describe(d *amqp.Delivery, fallbackQueue string) quarantined {
	s := func(k string) string {
		if v, ok := d.Headers[k].(string); ok {
			return v
		}
		return ""
	}
	m := quarantined{
		TaskID: s("id"), Task: s("task"), Reason: s(tasks.HeaderReason), Detail: s(tasks.HeaderDetail),
		Queue: s(tasks.HeaderQueue), QuarantinedAt: s(tasks.HeaderTime), ContentType: d.ContentType, Bytes: len(d.Body),
	}
	if m.TaskID == "" {
		m.TaskID = d.CorrelationID
	}
	if m.Task == "" || m.TaskID == "" {
		// Protocol 1 keeps both in the body.
		if msg, err := celeryproto.Decode(&d.Delivery); err == nil {
			m.Task, m.TaskID = msg.Task, msg.ID
		}
	}
	if m.Queue == "" {
		m.Queue = fallbackQueue
	}
	return m
}

// runAll runs the action on the quarantine of each queue in turn.
func (q *quarantine) runAll(ctx context.Context, action string, queues []string) error {
	var listed []quarantined
	for _, name := range queues {
		q.queue, q.qname = name, name+".quarantine"
		run := q.run
		if q.sqs != nil {
			run = q.runSQS
		}
		ms, err := run(ctx, action)
		if err != nil {
			return err
		}
		listed = append(listed, ms...)
	}
	if action == "list" && q.asJSON {
		if listed == nil {
			listed = []quarantined{}
		}
		return writeJSON(q.a.stdout, listed)
	}
	if len(q.ids) > 0 {
		missing := make([]string, 0, len(q.ids))
		for id := range q.ids {
			missing = append(missing, id)
		}
		sort.Strings(missing)
		if q.sqs != nil {
			return fmt.Errorf("not found in the quarantines of %s: %s", strings.Join(queues, ", "), strings.Join(missing, ", "))
		}
		return fmt.Errorf("not found in %s.quarantine: %s", strings.Join(queues, ".quarantine, "), strings.Join(missing, ", "))
	}
	return nil
}

// run acts on the quarantine of q.queue; it returns the messages listed.
func (q *quarantine) run(ctx context.Context, action string) ([]quarantined, error) {
	cfg := q.b.config("onceler quarantine")
	pub := amqp.NewPublisher(cfg)
	defer func() { _ = pub.Close() }()
	pctx, cancel := context.WithTimeout(ctx, connectTimeout)
	err := pub.Declare(pctx, amqp.QueueSpec{Name: q.qname, Exchange: amqp.DefaultExchange, Passive: true})
	cancel()
	if errors.Is(err, amqp.ErrNotFound) {
		if !q.asJSON || action != "list" {
			fmt.Fprintf(q.a.stdout, "no queue %s: nothing was ever quarantined from %s\n", q.qname, q.queue)
		}
		return nil, nil
	}
	if err != nil {
		return nil, brokerError("quarantine", cfg, err)
	}
	var listed []quarantined
	moved := 0
	seen, err := pub.Inspect(ctx, q.qname, q.limit, func(d *amqp.Delivery) (amqp.InspectAction, error) {
		m := describe(d, q.queue)
		if q.reason != "" && m.Reason != q.reason {
			return amqp.Keep, nil
		}
		switch action {
		case "list":
			listed = append(listed, m)
			return amqp.Keep, nil
		case "requeue", "drop":
			if !q.all && !q.ids[m.TaskID] {
				return amqp.Keep, nil
			}
			if action == "requeue" {
				if err := requeue(ctx, pub, d, m.Queue); err != nil {
					return amqp.Keep, err
				}
			}
			moved++
			delete(q.ids, m.TaskID)
			fmt.Fprintf(q.a.stdout, "%s %s (%s, %s)\n", pastTense(action), dash(m.TaskID), dash(m.Task), dash(m.Reason))
			return amqp.Remove, nil
		}
		return amqp.Keep, nil
	})
	if err != nil {
		if moved > 0 {
			return nil, fmt.Errorf("%s stopped after %d message(s): %s", action, moved, oneLine(err))
		}
		return nil, brokerError("quarantine", cfg, err)
	}
	return q.report(action, listed, seen, moved)
}

// report prints what a run of action over seen messages did (list: the
// messages, unless they are printed as JSON, which the caller does with
// what it returns; else how many were moved).
func (q *quarantine) report(action string, listed []quarantined, seen, moved int) ([]quarantined, error) {
	if action == "list" {
		if !q.asJSON {
			printQuarantined(q.a.stdout, q.qname, listed, seen, q.limit > 0 && seen == q.limit)
		}
		return listed, nil
	}
	fmt.Fprintf(q.a.stdout, "%s %d of %d message(s) in %s\n", pastTense(action), moved, seen, q.qname)
	return nil, nil
}

func pastTense(action string) string {
	if action == "requeue" {
		return "requeued"
	}
	return "dropped"
}

// requeue publishes the message back to the queue it came from, without the
// quarantine headers, and waits for the broker's confirm.
func requeue(ctx context.Context, pub *amqp.Publisher, d *amqp.Delivery, queue string) error {
	headers := make(map[string]any, len(d.Headers))
	for k, v := range d.Headers {
		if !strings.HasPrefix(k, "x-onceler-") {
			headers[k] = v
		}
	}
	p := &celeryproto.Publishing{
		ContentType: d.ContentType, ContentEncoding: d.ContentEncoding, Headers: headers, Body: d.Body,
		CorrelationID: d.CorrelationID, ReplyTo: d.ReplyTo, DeliveryMode: 2, Priority: d.Priority,
	}
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	if err := pub.Publish(wctx, "", queue, p, amqp.PublishOptions{Mandatory: true}); err != nil {
		return fmt.Errorf("republish to %s: %w", queue, err)
	}
	return nil
}

// printQuarantined prints the listed messages ms of the seen looked at;
// limited: the walk stopped at --limit, so the queue may hold more.
func printQuarantined(w io.Writer, qname string, ms []quarantined, seen int, limited bool) {
	more := ""
	if limited {
		more = " (--limit: there may be more)"
	}
	if len(ms) == 0 {
		fmt.Fprintf(w, "%s: no quarantined messages (of %d looked at)%s\n", qname, seen, more)
		return
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "TASK ID\tTASK\tREASON\tQUARANTINED AT\tDETAIL")
	for _, m := range ms {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", dash(m.TaskID), dash(m.Task), dash(m.Reason), dash(m.QuarantinedAt), dash(truncate(m.Detail, 70)))
	}
	_ = tw.Flush()
	if limited {
		fmt.Fprintf(w, "%d message(s) among the first %d in %s%s\n", len(ms), seen, qname, more)
		return
	}
	fmt.Fprintf(w, "%d message(s) in %s\n", len(ms), qname)
}
