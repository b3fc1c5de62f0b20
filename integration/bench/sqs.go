package main

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"go.uber.org/zap"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/sqs"
)

// The SQS scenarios: N Celery messages of bench.outside pre-sent as kombu's
// SQS transport writes them (Celery's broker_url "sqs://") to a queue of
// the -sqs server (goaws, started by .ci/setup), drained by (sqs-raw) a raw
// loop of batched long-poll receives and batched deletes with the same
// window (the ceiling of any consumer that deletes a message only after
// handling it) or (sqs) the onceler worker with tasks.Config.SQS and the
// record, on the same server in the same run.

// sqsClient is a client of the bench's SQS server (a local server checks
// no signature: static credentials of the bench's own).
func sqsClient(ctx context.Context, endpoint string) (*sqs.Client, error) {
	return sqs.New(ctx, sqs.Config{Endpoint: endpoint, Region: "us-east-1",
		Credentials: credentials.NewStaticCredentialsProvider("onceler-bench", "onceler-bench", "")})
}

// drainSQS is drain for the SQS scenarios.
func (b *bench) drainSQS(ctx context.Context, sc scenario) row {
	r := row{sc: sc, n: b.o.n}
	queue, schema := b.names(sc, "")
	c, err := sqsClient(ctx, b.o.sqsEndpoint)
	if err != nil {
		r.drainError = err
		return r
	}
	defer func() { _ = c.Close() }()
	var qurl string
	defer func() {
		ctx := context.WithoutCancel(ctx)
		for _, q := range []string{queue, queue + "-quarantine"} {
			if u, err := c.QueueURL(ctx, q); err == nil {
				_, _ = c.API().DeleteQueue(ctx, &awssqs.DeleteQueueInput{QueueUrl: aws.String(u)})
			}
		}
		_ = dropSchema(ctx, b.o.dbURL, schema)
	}()
	r.drainError = func() error {
		if qurl, err = c.CreateQueue(ctx, queue, map[string]string{"VisibilityTimeout": "5"}); err != nil {
			return err
		}
		if err := setupSchema(ctx, b.o.dbURL, schema); err != nil {
			return err
		}
		msgs, ops, err := msgSpec{Task: taskOutside, N: r.n, RunID: b.runID + sc.ID, Ignore: true}.build()
		if err != nil {
			return err
		}
		t0 := time.Now()
		if err := sendKombu(ctx, c, qurl, queue, msgs); err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "(%s) pre-sent %d Celery messages (kombu's SQS envelope) in %v\n", sc.ID, r.n, time.Since(t0).Round(time.Millisecond))
		c0, err := b.commits.read(ctx)
		if err != nil {
			return err
		}
		job := b.consumerJob(sc.Kind, queue, schema, r.n)
		job.SQSEndpoint = b.o.sqsEndpoint
		res, err := b.drainQueued(ctx, sc, &r, job, procPID("goaws"), c0)
		if err != nil {
			return err
		}
		if n := res.Counts["receive_errors"]; n > 0 {
			r.note = fmt.Sprintf("%.0f receives failed; their messages came back after the 5 s visibility timeout", n)
		}
		// Every message deleted, every operation completed in the record.
		info, err := c.API().GetQueueAttributes(ctx, &awssqs.GetQueueAttributesInput{QueueUrl: aws.String(qurl),
			AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameApproximateNumberOfMessages,
				types.QueueAttributeNameApproximateNumberOfMessagesNotVisible}})
		if err != nil {
			return fmt.Errorf("queue attributes: %w", err)
		}
		if a, n := info.Attributes["ApproximateNumberOfMessages"], info.Attributes["ApproximateNumberOfMessagesNotVisible"]; a != "0" || n != "0" {
			return fmt.Errorf("after the run the queue holds %s messages, %s in flight", a, n)
		}
		if sc.Kind == "sqs-raw" {
			return nil
		}
		return verifyCompleted(ctx, b.o.dbURL, schema, len(ops))
	}()
	return r
}

// sendKombu sends the messages as kombu's SQS transport does, 32 at a
// time.
func sendKombu(ctx context.Context, c *sqs.Client, qurl, queue string, msgs []*celeryproto.Publishing) error {
	var next atomic.Int64
	var failed atomic.Value
	var wg sync.WaitGroup
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1) - 1)
				if i >= len(msgs) || failed.Load() != nil {
					return
				}
				body, err := sqs.EncodeKombu(msgs[i], queue)
				if err == nil {
					_, err = c.Send(ctx, qurl, sqs.Outgoing{Body: body})
				}
				if err != nil {
					failed.Store(fmt.Errorf("send: %w", err))
					return
				}
			}
		}()
	}
	wg.Wait()
	if err, _ := failed.Load().(error); err != nil {
		return err
	}
	return nil
}

// runSQSRaw is the ceiling of the SQS scenarios: receivers take up to ten
// messages a receive (long polling) while fewer than job.Prefetch are out,
// and job.Concurrency goroutines delete each (batched, as the worker
// deletes), nothing else.
func runSQSRaw(ctx context.Context, job childJob) (childResult, error) {
	var res childResult
	c, err := sqsClient(ctx, job.SQSEndpoint)
	if err != nil {
		return res, err
	}
	defer func() { _ = c.Close() }()
	qurl, err := c.QueueURL(ctx, job.Queue)
	if err != nil {
		return res, fmt.Errorf("sqs-raw: %w", err)
	}
	fmt.Println("READY")
	stop := startProfile(job)
	defer stop()
	set := startRawSettlers(job, func(h string) error {
		if err := c.Delete(ctx, qurl, h); err != nil {
			return fmt.Errorf("sqs-raw: delete: %w", err)
		}
		return nil
	})
	var received, receiveErrors atomic.Int64
	pollers := min(max(job.Prefetch/sqs.MaxBatch, 1), 8) // as the worker's transport
	var pwg sync.WaitGroup
	for range pollers {
		pwg.Add(1)
		go func() {
			defer pwg.Done()
			for received.Load() < int64(job.Expect) && set.err() == nil && ctx.Err() == nil {
				n := 0
				for n < sqs.MaxBatch {
					if n > 0 {
						select {
						case set.window <- struct{}{}:
							n++
							continue
						default:
						}
						break
					}
					select {
					case set.window <- struct{}{}:
						n++
					case <-ctx.Done():
						return
					}
				}
				msgs, err := c.Receive(ctx, job.Queue, n, time.Second, 0)
				for range n - len(msgs) {
					<-set.window
				}
				if err != nil {
					if ctx.Err() != nil {
						return
					}
					// A receive that failed: its messages, if the
					// server took them, come back when their
					// visibility timeouts run out, as for the worker.
					receiveErrors.Add(1)
					continue
				}
				received.Add(int64(len(msgs)))
				for _, m := range msgs {
					set.work <- m.ReceiptHandle
				}
			}
		}()
	}
	pwg.Wait()
	res = set.finish()
	res.Counts = map[string]float64{"receive_errors": float64(receiveErrors.Load())}
	err = set.err()
	if err == nil && res.Done < job.Expect {
		err = fmt.Errorf("sqs-raw: %d of %d", res.Done, job.Expect)
	}
	return res, err
}

// sqsConfig is the worker's SQS configuration in the SQS scenarios, else
// nil.
func sqsConfig(job childJob, log *zap.Logger) *sqs.Config {
	if job.SQSEndpoint == "" {
		return nil
	}
	return &sqs.Config{Endpoint: job.SQSEndpoint, Region: "us-east-1", Queues: []sqs.Queue{{Name: job.Queue}}, Wait: time.Second,
		Credentials: credentials.NewStaticCredentialsProvider("onceler-bench", "onceler-bench", ""), Logger: log}
}

// procPID is the process id of a process named comm on this machine (the
// first found), 0 when there is none.
func procPID(comm string) int {
	dirs, _ := os.ReadDir("/proc")
	for _, d := range dirs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		if b, err := os.ReadFile("/proc/" + d.Name() + "/comm"); err == nil && strings.TrimSpace(string(b)) == comm {
			return pid
		}
	}
	return 0
}
