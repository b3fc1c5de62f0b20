package cmd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/sidekiq"
	"github.com/onceler/onceler/sqs"
	"github.com/onceler/onceler/tasks"
)

// brokerFlags are the flags of every command that talks to RabbitMQ.
type brokerFlags struct {
	url, caFile, certFile, keyFile string
}

func (b *brokerFlags) define(fs *flagSet) {
	fs.Secret(&b.url, "broker-url", "URL", DefaultBrokerURL,
		"RabbitMQ URL (amqp://, amqps://; Celery's amqp://host// and pyamqp:// spellings accepted); "+
			"several separated by ';', as Celery's broker_url, are a failover list for the nodes of one cluster: "+
			"after a failed attempt or a lost connection the next attempt goes to the next URL")
	fs.String(&b.caFile, "broker-ca-file", "FILE", "", "CA bundle (PEM) that verifies an amqps:// broker; default the system roots")
	fs.String(&b.certFile, "broker-cert-file", "FILE", "", "client certificate (PEM) for mutual TLS with the broker")
	fs.String(&b.keyFile, "broker-key-file", "FILE", "", "client key (PEM) for mutual TLS with the broker")
}

func (b *brokerFlags) config(name string) amqp.Config {
	return amqp.Config{
		URL:        b.url,
		TLS:        amqp.TLSConfig{CAFile: b.caFile, CertFile: b.certFile, KeyFile: b.keyFile},
		Name:       name,
		MaxBackoff: time.Second,
	}
}

// brokerError turns a failure to reach or use the broker into one line.
func brokerError(cmd string, cfg amqp.Config, err error) error {
	var ae *amqp.AccessError
	switch {
	case errors.As(err, &ae):
		return accessError(ae)
	case errors.Is(err, amqp.ErrConfig):
		return usagef(cmd, "%s", oneLine(err))
	case errors.Is(err, amqp.ErrPrecondition), errors.Is(err, amqp.ErrNotFound), errors.Is(err, amqp.ErrAccessRefused):
		return fmt.Errorf("RabbitMQ at %s refused: %s", amqp.RedactURL(cfg.URL), oneLine(err))
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled):
		return fmt.Errorf("cannot reach RabbitMQ at %s within %s; check --broker-url (ONCELER_BROKER_URL) and that the broker is running",
			amqp.RedactURL(cfg.URL), connectTimeout)
	default:
		return fmt.Errorf("cannot reach RabbitMQ at %s: %s; check --broker-url (ONCELER_BROKER_URL) and that the broker is running",
			amqp.RedactURL(cfg.URL), oneLine(err))
	}
}

// accessError is the line of a permission RabbitMQ refused: the
// permission, the resource, the user and vhost, what for, and where the
// permissions the worker needs are listed.
func accessError(ae *amqp.AccessError) error {
	return fmt.Errorf("%s; see docs/security.md", oneLine(ae))
}

func resolveCommand() *command {
	return &command{
		name:    "resolve",
		args:    "TASK KEY",
		summary: "settle a held operation: mark it completed, or run it again",
		long: `Settles a held record: an outside-system operation whose worker died
without recording an outcome, under the stale-claim policy hold. Find out in
the outside system whether the effect happened, then:

  --completed [--result JSON]  it happened: record it completed; duplicates
                               get the result (JSON; default null)
  --retry                      it did not happen: release the record and
                               republish the message kept with it, so a
                               worker runs the task again (a Sidekiq job's:
                               pushed again to its queue in --sidekiq's
                               Redis; an SQS message's: sent again to its
                               queue, by the AWS SDK's configuration or
                               --sqs-endpoint)

'onceler records --status held' lists the held records.`,
		setup: func(a *app, fs *flagSet) func(context.Context, []string) error {
			var (
				d                dbFlags
				b                brokerFlags
				completed, retry bool
				result           string
				sidekiqURL       string
				sqsEndpoint      string
			)
			d.define(fs)
			b.define(fs)
			fs.Bool(&completed, "completed", "the operation happened: mark the record completed")
			fs.String(&result, "result", "JSON", "", "with --completed: the result duplicates are answered with (JSON)")
			fs.Bool(&retry, "retry", "the operation did not happen: release the record and republish its stored message")
			fs.Secret(&sidekiqURL, "sidekiq", "URL", "", "with --retry, for the record of a Sidekiq job: the Redis its job is pushed again to (the worker's --sidekiq)")
			fs.String(&sqsEndpoint, "sqs-endpoint", "URL", "", "with --retry, for the record of an SQS message: the SQS endpoint it is sent again to, instead of the AWS SDK's (the worker's --sqs-endpoint)")
			fs.CommandLineOnly("completed")
			fs.CommandLineOnly("retry")
			return func(ctx context.Context, args []string) error {
				if len(args) != 2 {
					return usagef("resolve", "want TASK and KEY, got %d argument(s)", len(args))
				}
				if completed == retry {
					return usagef("resolve", "give exactly one of --completed and --retry")
				}
				var res []byte
				if result != "" {
					if !completed {
						return usagef("resolve", "--result goes with --completed")
					}
					if !json.Valid([]byte(result)) {
						return usagef("resolve", "--result is not valid JSON (quote strings: --result '\"done\"')")
					}
					res = []byte(result)
				}
				pool, store, err := openStore(ctx, "resolve", d, zap.NewNop(), idempotency.BatchConfig{})
				if err != nil {
					return err
				}
				defer pool.Close()
				defer store.Close()
				if err := a.checkPrivileges(ctx, "resolve", store, d.schema, idempotency.ResolvePrivileges(), "--grant-to"); err != nil {
					return err
				}
				task, key := args[0], args[1]
				if completed {
					if err := store.ResolveCompleted(ctx, task, key, res); err != nil {
						return resolveError(a.prog, d.schema, task, key, err)
					}
					fmt.Fprintf(a.stdout, "%s %s: completed\n", task, key)
					return nil
				}
				return a.resolveRetry(ctx, store, d.schema, b, sidekiqURL, sqsEndpoint, task, key)
			}
		},
	}
}

func resolveError(prog, schema, task, key string, err error) error {
	switch {
	case errors.Is(err, idempotency.ErrNotFound):
		return fmt.Errorf("no record for task %q key %q in schema %q", task, key, schema)
	case errors.Is(err, idempotency.ErrNotHeld):
		return fmt.Errorf("record %s %s is not held; only held records are resolved ('%s records --task %s --key %s' shows it)", task, key, prog, task, key)
	default:
		return fmt.Errorf("resolve %s %s: %s", task, key, schemaHint(prog, schema, err))
	}
}

// resolveRetry checks the broker first, then releases the record and
// republishes its message. The record is released before the message is
// published: a worker that got the message while the record was still held
// would acknowledge it and keep the operation held.
func (a *app) resolveRetry(ctx context.Context, store *idempotency.Store, schema string, b brokerFlags, sidekiqURL, sqsEndpoint, task, key string) error {
	rec, err := store.Get(ctx, task, key)
	if err != nil {
		return resolveError(a.prog, schema, task, key, err)
	}
	if rec.Status != idempotency.StatusHeld {
		return resolveError(a.prog, schema, task, key, idempotency.ErrNotHeld)
	}
	if len(rec.Message) == 0 {
		return fmt.Errorf("record %s %s keeps no message to republish: send the operation again from its producer, or resolve it --completed", task, key)
	}
	if queue, job, ok := tasks.DecodeHeldSidekiq(rec.Message); ok {
		return a.resolveRetrySidekiq(ctx, store, schema, sidekiqURL, task, key, queue, job)
	}
	if queue, m, ok := tasks.DecodeHeldSQS(rec.Message); ok {
		return a.resolveRetrySQS(ctx, store, schema, sqsEndpoint, task, key, queue, m)
	}
	exchange, routingKey, pubMsg, err := tasks.DecodeHeld(rec.Message)
	if err != nil {
		return fmt.Errorf("record %s %s: %w", task, key, err)
	}
	cfg := b.config("onceler resolve")
	pub := amqp.NewPublisher(cfg)
	defer func() { _ = pub.Close() }()
	pctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	if exchange == "" {
		// The broker answers and the queue is there.
		if err := pub.Declare(pctx, amqp.QueueSpec{Name: routingKey, Exchange: amqp.DefaultExchange, Passive: true}); err != nil {
			return brokerError("resolve", cfg, err)
		}
	}
	if _, err := store.ResolveRetry(ctx, task, key); err != nil {
		return resolveError(a.prog, schema, task, key, err)
	}
	// The record is released: the publish must not be cut short by ^C.
	wctx, wcancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer wcancel()
	err = pub.Publish(wctx, exchange, routingKey, pubMsg, amqp.PublishOptions{Mandatory: true})
	if err != nil {
		return fmt.Errorf("record %s %s was released but its message could not be republished (%s): send the operation again from its producer",
			task, key, oneLine(err))
	}
	fmt.Fprintf(a.stdout, "%s %s: released and republished to %s\n", task, key, describeRoute(exchange, routingKey))
	return nil
}

// resolveRetrySidekiq is resolveRetry for the record of a Sidekiq job:
// Redis is checked first, then the record released and the job pushed
// again to its queue.
func (a *app) resolveRetrySidekiq(ctx context.Context, store *idempotency.Store, schema, sidekiqURL, task, key, queue, job string) error {
	if sidekiqURL == "" {
		return usagef("resolve", "record %s %s keeps a Sidekiq job: give --sidekiq URL, the Redis to push it again to", task, key)
	}
	p, err := sidekiq.NewProducer(sidekiqURL)
	if err != nil {
		return usagef("resolve", "invalid --sidekiq: %s", oneLine(err))
	}
	defer func() { _ = p.Close() }()
	pctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	if err := p.Ping(pctx); err != nil {
		return fmt.Errorf("cannot reach Redis: %s", oneLine(err))
	}
	if _, err := store.ResolveRetry(ctx, task, key); err != nil {
		return resolveError(a.prog, schema, task, key, err)
	}
	wctx, wcancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer wcancel()
	if err := p.PushRaw(wctx, queue, job); err != nil {
		return fmt.Errorf("record %s %s was released but its Sidekiq job could not be pushed again (%s): push it again from its producer",
			task, key, oneLine(err))
	}
	fmt.Fprintf(a.stdout, "%s %s: released and pushed again to Sidekiq queue %s\n", task, key, queue)
	return nil
}

func describeRoute(exchange, routingKey string) string {
	if exchange == "" {
		return "queue " + routingKey
	}
	return "exchange " + exchange + " with routing key " + routingKey
}

// resolveRetrySQS is resolveRetry for the record of an SQS message: the
// queue is looked up first, then the record released and the message sent
// again to its queue.
func (a *app) resolveRetrySQS(ctx context.Context, store *idempotency.Store, schema, endpoint, task, key, queue string, m sqs.Outgoing) error {
	c, err := sqs.New(ctx, sqs.Config{Endpoint: endpoint})
	if err != nil {
		return err
	}
	defer func() { _ = c.Close() }()
	pctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	u, err := c.QueueURL(pctx, queue)
	if err != nil {
		return fmt.Errorf("cannot reach SQS queue %s: %s", queue, oneLine(err))
	}
	if _, err := store.ResolveRetry(ctx, task, key); err != nil {
		return resolveError(a.prog, schema, task, key, err)
	}
	wctx, wcancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer wcancel()
	if _, err := c.Send(wctx, u, m); err != nil {
		return fmt.Errorf("record %s %s was released but its SQS message could not be sent again (%s): send it again from its producer",
			task, key, oneLine(err))
	}
	fmt.Fprintf(a.stdout, "%s %s: released and sent again to SQS queue %s\n", task, key, queue)
	return nil
}
