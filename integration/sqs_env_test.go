package integration

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/redis/go-redis/v9"

	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
	"github.com/onceler/onceler/sqs"
)

// The SQS tests' world: the local SQS server (goaws, testkit.SQSEndpoint),
// a queue of the test's own, a record schema, a Redis database for the
// results, onceler workers started with --sqs, and real producers: Celery
// 5.2.6 over kombu's SQS transport (testdata/sqs_celery.py) and boto3
// (testdata/sqs_plain.py).

// sqsEnv is one test's SQS world.
type sqsEnv struct {
	endpoint   string
	client     *sqs.Client
	queue      string
	queueURL   string
	visibility time.Duration
	redisURL   string
	rdb        *redis.Client

	queueEnv
}

// sqsEnvOptions shape a test's world.
type sqsEnvOptions struct {
	// Visibility is the queue's visibility timeout (default 4 s).
	Visibility time.Duration
	// Attributes are more attributes of the queue.
	Attributes map[string]string
	// FIFO makes the queue a FIFO queue.
	FIFO bool
	// NoRedis: no result backend.
	NoRedis bool
}

func newSQSEnv(t *testing.T, o sqsEnvOptions) *sqsEnv {
	t.Helper()
	ep := testkit.SQSEndpoint(t)
	dbURL := testkit.Postgres.URL(t)
	if o.Visibility <= 0 {
		o.Visibility = 4 * time.Second
	}
	e := &sqsEnv{endpoint: ep, visibility: o.Visibility, queue: strings.ReplaceAll(testkit.Name("sqs"), "_", "-"),
		queueEnv: queueEnv{t: t, dbURL: dbURL, lease: 2 * time.Second}}
	if o.FIFO {
		e.queue += ".fifo"
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c, err := sqs.New(ctx, sqs.Config{Endpoint: ep, Region: "us-east-1",
		Credentials: credentials.NewStaticCredentialsProvider("onceler-test", "onceler-test", "")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	e.client = c
	attrs := map[string]string{"VisibilityTimeout": strconv.Itoa(int(o.Visibility / time.Second))}
	for k, v := range o.Attributes {
		attrs[k] = v
	}
	if e.queueURL, err = c.CreateQueue(ctx, e.queue, attrs); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, q := range []string{e.queue, sqsQuarantineOf(e.queue)} {
			if u, err := c.QueueURL(context.Background(), q); err == nil {
				_, _ = c.API().DeleteQueue(context.Background(), &awssqs.DeleteQueueInput{QueueUrl: aws.String(u)})
			}
		}
	})
	if !o.NoRedis {
		e.redisURL, e.rdb = testkit.RedisDB(t, testkit.RedisAddr(t))
	}
	e.setupRecord("sqs")
	return e
}

// sqsQuarantineOf is the quarantine queue of q (no dead-letter queue).
func sqsQuarantineOf(q string) string {
	if base, ok := strings.CutSuffix(q, ".fifo"); ok {
		return base + "-quarantine.fifo"
	}
	return q + "-quarantine"
}

// sqsCall is one call of the Celery producer.
type sqsCall struct {
	Task      string         `json:"task,omitempty"`
	Args      []any          `json:"args,omitempty"`
	Kwargs    map[string]any `json:"kwargs,omitempty"`
	ID        string         `json:"id,omitempty"`
	Countdown float64        `json:"countdown,omitempty"`
	Expires   float64        `json:"expires,omitempty"`
	Chain     []sqsCall      `json:"chain,omitempty"`
}

// sqsCeleryOut is what the Celery producer reports.
type sqsCeleryOut struct {
	IDs     []string `json:"ids"`
	Results []struct {
		Status string          `json:"status"`
		Value  json.RawMessage `json:"value"`
	} `json:"results"`
}

// celery sends calls with Celery 5.2.6 (kombu's SQS transport) to the
// test's queue; wait > 0: each result is waited for with get() (the Redis
// result backend).
func (e *sqsEnv) celery(calls []sqsCall, wait time.Duration) sqsCeleryOut {
	e.t.Helper()
	spec := map[string]any{"endpoint": e.endpoint, "queue": e.queue, "calls": calls,
		"visibility": int(e.visibility / time.Second), "wait": int(wait / time.Second)}
	if e.redisURL != "" {
		spec["backend"] = e.redisURL
	}
	var out sqsCeleryOut
	e.python("sqs_celery.py", spec, &out, wait+2*time.Minute)
	return out
}

// sqsMessage is one message of the plain producer.
type sqsMessage struct {
	Body       string            `json:"body"`
	Attributes map[string]string `json:"attributes,omitempty"`
	Group      string            `json:"group,omitempty"`
}

// plain sends messages with boto3 to the test's queue; returns their ids.
func (e *sqsEnv) plain(msgs ...sqsMessage) []string {
	e.t.Helper()
	var ids []string
	e.python("sqs_plain.py", map[string]any{"endpoint": e.endpoint, "queue": e.queue, "messages": msgs}, &ids, 2*time.Minute)
	return ids
}

func (e *sqsEnv) python(script string, spec, out any, timeout time.Duration) {
	e.t.Helper()
	b, err := json.Marshal(spec)
	if err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	c := exec.CommandContext(ctx, testenv.Python(e.t), filepath.Join("testdata", script), string(b))
	c.Env = append(os.Environ(), testkit.SQSEnv()...)
	var stderr strings.Builder
	c.Stderr = &stderr
	o, err := c.Output()
	if err != nil {
		e.t.Fatalf("%s: %v\n%s", script, err, stderr.String())
	}
	if err := json.Unmarshal(o, out); err != nil {
		e.t.Fatalf("%s output %q: %v", script, o, err)
	}
}

// depth is the number of messages in the queue named q, visible or in
// flight (-1 when unknown); 0 is exact, others approximate.
func (e *sqsEnv) depth(q string) int {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	u, err := e.client.QueueURL(ctx, q)
	if err != nil {
		return -1
	}
	out, err := e.client.API().GetQueueAttributes(ctx, &awssqs.GetQueueAttributesInput{QueueUrl: aws.String(u),
		AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameApproximateNumberOfMessages,
			types.QueueAttributeNameApproximateNumberOfMessagesNotVisible}})
	if err != nil {
		return -1
	}
	a, _ := strconv.Atoi(out.Attributes["ApproximateNumberOfMessages"])
	b, _ := strconv.Atoi(out.Attributes["ApproximateNumberOfMessagesNotVisible"])
	// SQS counts the visible ones in the first, goaws all of them.
	return max(a, b)
}

// idle reports whether the test's queue is empty (nothing visible, nothing
// in flight).
func (e *sqsEnv) idle() bool { return e.depth(e.queue) == 0 }

// drain receives the messages of the queue named q (each is deleted)
// until it has want of them, or finds none for 40 s. A receive that fails
// after the server took its messages leaves them in flight until the
// queue's visibility timeout ends (goaws ignores the 2 s drain
// asks for, and a queue the worker creates has SQS's default of 30 s):
// they come again then.
func (e *sqsEnv) drain(q string, want int) []sqs.Message {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var all []sqs.Message
	quiet := time.Now()
	for len(all) < want && time.Since(quiet) < 40*time.Second {
		msgs, err := e.client.Receive(ctx, q, sqs.MaxBatch, 0, 2*time.Second)
		if err != nil || len(msgs) == 0 {
			time.Sleep(200 * time.Millisecond)
			continue
		}
		quiet = time.Now()
		for _, m := range msgs {
			if err := e.client.Delete(ctx, m.QueueURL, m.ReceiptHandle); err != nil {
				e.t.Fatalf("delete from %s: %v", q, err)
			}
		}
		all = append(all, msgs...)
	}
	return all
}

// sqsWorkerOptions are the settings of one worker process.
type sqsWorkerOptions = queueWorkerOptions

// startWorker starts onceler worker --sqs and waits until it consumes.
func (e *sqsEnv) startWorker(o sqsWorkerOptions) *skWorker {
	e.t.Helper()
	name := e.nextName("sqs")
	transport := append(testkit.SQSEnv(),
		"ONCELER_SQS=true",
		"ONCELER_SQS_ENDPOINT="+e.endpoint,
		"ONCELER_SQS_WAIT=1s")
	if e.redisURL != "" {
		transport = append(transport, "ONCELER_RESULT_BACKEND="+e.redisURL)
	}
	env := e.workerEnv(o, name, e.queue, []string{"ONCELER_", "AWS_"}, transport...)
	var crashedEarly func(*skWorker) bool
	if o.MayCrash {
		crashedEarly = func(*skWorker) bool { return true }
	}
	return e.start(e.t, name, env, crashedEarly)
}
