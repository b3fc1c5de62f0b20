package sqs

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/aws/aws-sdk-go-v2/aws"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/aws/smithy-go"
	"go.uber.org/zap"

	"github.com/onceler/onceler/celeryproto"
)

// Limits of SQS itself.
const (
	// MaxBatch is the most messages one ReceiveMessage returns and the
	// most entries of one batch request.
	MaxBatch = 10
	// MaxDelay is the longest DelaySeconds of a message.
	MaxDelay = 15 * time.Minute
	// MaxVisibility is the longest visibility timeout (12 hours).
	MaxVisibility = 12 * time.Hour
	// MaxWait is the longest long poll (WaitTimeSeconds).
	MaxWait = 20 * time.Second
	// MaxAttributes is the most message attributes of one message.
	MaxAttributes = 10
	// MaxMessageSize is a queue's MaximumMessageSize when it reports none
	// (SQS's default): the most bytes of a message's body and its
	// attributes' names, data types and values (Size).
	MaxMessageSize = 262144
)

// maxConns is the most idle connections a Client keeps to its endpoint.
const maxConns = 256

// ErrGone is the error (wrapped) of a call on a receipt handle the queue
// no longer knows as in flight: its visibility timeout ran out (the
// message is visible again, or was received by someone else), or it was
// deleted.
var ErrGone = errors.New("sqs: message no longer in flight under this receipt handle")

// ErrRefused is the error (wrapped) of a send SQS refuses for what the
// message is: over the queue's size limit or SQS's ten attributes, a
// character SQS does not take, an invalid attribute. Sending it again
// gives the same answer.
var ErrRefused = errors.New("sqs: message refused")

// Config configures a Client.
type Config struct {
	// Endpoint, when set, is the SQS endpoint (a local server:
	// http://127.0.0.1:4100); otherwise the SDK's configuration decides
	// (AWS_ENDPOINT_URL_SQS, AWS_ENDPOINT_URL, the region's endpoint).
	Endpoint string
	// Region, when set, overrides the SDK's configured region. With
	// Endpoint set and no region configured, "us-east-1".
	Region string
	// Credentials, when set, are used instead of the SDK's credential
	// chain.
	Credentials aws.CredentialsProvider
	// Logger receives the client's logs (default: none).
	Logger *zap.Logger

	// What a worker consumes (tasks.Config.SQS); the Client itself does
	// not read them.

	// Queues are the queues consumed.
	Queues []Queue
	// Wait is how long one receive waits for a message (long polling;
	// default 10 s, at most 20 s).
	Wait time.Duration
	// Visibility is the visibility timeout messages are received with and
	// extended by, again and again, while they are held (default: each
	// queue's own VisibilityTimeout attribute; at least 2 s).
	Visibility time.Duration
}

// Queue is a queue consumed.
type Queue struct {
	// Name is the queue's name.
	Name string
	// Task is the task of its plain messages that have no "task"
	// attribute ("": such a message is quarantined).
	Task string
}

// Client is a client of one SQS endpoint. Its methods are safe for
// concurrent use.
type Client struct {
	api *sqs.Client
	log *zap.Logger
	tr  *http.Transport

	mu   sync.Mutex
	urls map[string]string // queue name -> URL
	// noVisBatch: the server has no ChangeMessageVisibilityBatch (goaws):
	// visibility changes go one call each.
	noVisBatch bool

	del     chan deleteReq
	delDone chan struct{}
	closing sync.Once
}

// New opens a client with the SDK's default configuration and cfg's
// overrides.
func New(ctx context.Context, cfg Config) (*Client, error) {
	var opts []func(*config.LoadOptions) error
	if cfg.Region != "" {
		opts = append(opts, config.WithRegion(cfg.Region))
	}
	if cfg.Credentials != nil {
		opts = append(opts, config.WithCredentialsProvider(cfg.Credentials))
	}
	ac, err := config.LoadDefaultConfig(ctx, opts...)
	if err != nil {
		return nil, fmt.Errorf("sqs: load AWS configuration: %w", err)
	}
	if ac.Region == "" {
		if cfg.Endpoint == "" {
			return nil, errors.New("sqs: no AWS region configured (AWS_REGION, the shared config's region)")
		}
		ac.Region = "us-east-1"
	}
	// A transport of the client's own (the configuration's: its CA bundle,
	// timeouts), whose connections Close closes.
	var tr *http.Transport
	if bc, ok := ac.HTTPClient.(*awshttp.BuildableClient); ok {
		tr = bc.GetTransport()
	} else {
		tr = awshttp.NewBuildableClient().GetTransport()
	}
	// Every connection to the one SQS host is kept for reuse: with the
	// SDK's 10 per host, the connections of the receives, deletes and
	// visibility changes under way at once were closed and opened again
	// all the time.
	tr.MaxIdleConns = max(tr.MaxIdleConns, maxConns)
	tr.MaxIdleConnsPerHost = maxConns
	return newClient(ac, tr, cfg), nil
}

// newClient is New's client of the SDK configuration ac over the
// transport tr.
func newClient(ac aws.Config, tr *http.Transport, cfg Config) *Client {
	api := sqs.NewFromConfig(ac, func(o *sqs.Options) {
		o.HTTPClient = &http.Client{Transport: ownBodies{tr}}
		if cfg.Endpoint != "" {
			o.BaseEndpoint = aws.String(cfg.Endpoint)
		}
	})
	log := cfg.Logger
	if log == nil {
		log = zap.NewNop()
	}
	c := &Client{api: api, log: log, tr: tr, urls: map[string]string{}, del: make(chan deleteReq, 256), delDone: make(chan struct{})}
	go c.deleter()
	return c
}

// ownBodies hands the transport a copy of each request's body that the
// transport alone holds. The SDK closes the body it sent as soon as the
// response's headers arrive; the transport, which can still be finishing
// the request's write then (checking that the body has no bytes past its
// Content-Length), took the closed body's io.EOF for a failed write and
// closed the connection under the response being read: "use of closed
// network connection" while decoding a 200 response, and for a receive,
// messages hidden for their visibility timeout that nobody got.
type ownBodies struct{ rt http.RoundTripper }

func (o ownBodies) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.Body == nil || r.Body == http.NoBody {
		return o.rt.RoundTrip(r)
	}
	var b []byte
	var err error
	if r.ContentLength > 0 {
		b = make([]byte, r.ContentLength)
		_, err = io.ReadFull(r.Body, b)
	} else {
		b, err = io.ReadAll(r.Body)
	}
	_ = r.Body.Close()
	if err != nil {
		return nil, fmt.Errorf("sqs: read request body: %w", err)
	}
	own := r.WithContext(r.Context())
	own.ContentLength = int64(len(b))
	own.GetBody = func() (io.ReadCloser, error) {
		if len(b) == 0 {
			return http.NoBody, nil
		}
		return io.NopCloser(bytes.NewReader(b)), nil
	}
	own.Body, _ = own.GetBody()
	return o.rt.RoundTrip(own)
}

// Close stops the client's batched deletes (those queued are sent first).
func (c *Client) Close() error {
	c.closing.Do(func() { close(c.del) })
	<-c.delDone
	c.tr.CloseIdleConnections()
	return nil
}

// API is the SDK's client, for what this package does not wrap.
func (c *Client) API() *sqs.Client { return c.api }

// QueueURL is the URL of the queue named name (cached).
func (c *Client) QueueURL(ctx context.Context, name string) (string, error) {
	c.mu.Lock()
	u, ok := c.urls[name]
	c.mu.Unlock()
	if ok {
		return u, nil
	}
	out, err := c.api.GetQueueUrl(ctx, &sqs.GetQueueUrlInput{QueueName: aws.String(name)})
	if err != nil {
		return "", fmt.Errorf("sqs: queue %s: %w", name, err)
	}
	u = aws.ToString(out.QueueUrl)
	c.mu.Lock()
	c.urls[name] = u
	c.mu.Unlock()
	return u, nil
}

// CreateQueue creates the queue named name with attrs unless it exists,
// and returns its URL. A name ending in ".fifo" makes a FIFO queue.
func (c *Client) CreateQueue(ctx context.Context, name string, attrs map[string]string) (string, error) {
	if strings.HasSuffix(name, ".fifo") {
		a := map[string]string{"FifoQueue": "true"}
		for k, v := range attrs {
			a[k] = v
		}
		attrs = a
	}
	out, err := c.api.CreateQueue(ctx, &sqs.CreateQueueInput{QueueName: aws.String(name), Attributes: attrs})
	if err != nil {
		return "", fmt.Errorf("sqs: create queue %s: %w", name, err)
	}
	u := aws.ToString(out.QueueUrl)
	c.mu.Lock()
	c.urls[name] = u
	c.mu.Unlock()
	return u, nil
}

// QueueInfo is what the consumer reads of a queue's attributes.
type QueueInfo struct {
	URL string
	// Visibility is the queue's default visibility timeout.
	Visibility time.Duration
	// DeadLetter is the name of the dead-letter queue its redrive policy
	// names ("" when none).
	DeadLetter string
	// FIFO: a FIFO queue.
	FIFO bool
	// MaxMessageSize is the queue's MaximumMessageSize (MaxMessageSize
	// when it reports none).
	MaxMessageSize int
}

// Info reads the queue's attributes; create: a missing queue is created
// (with SQS's default attributes), as kombu creates the queues it uses.
func (c *Client) Info(ctx context.Context, name string, create bool) (QueueInfo, error) {
	u, err := c.QueueURL(ctx, name)
	if err != nil && create && NotFound(err) {
		u, err = c.CreateQueue(ctx, name, nil)
	}
	if err != nil {
		return QueueInfo{}, err
	}
	out, err := c.api.GetQueueAttributes(ctx, &sqs.GetQueueAttributesInput{QueueUrl: aws.String(u),
		AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameAll}})
	if err != nil {
		return QueueInfo{}, fmt.Errorf("sqs: attributes of queue %s: %w", name, err)
	}
	info := QueueInfo{URL: u, FIFO: strings.HasSuffix(name, ".fifo") || out.Attributes["FifoQueue"] == "true"}
	if v, err := strconv.Atoi(out.Attributes["VisibilityTimeout"]); err == nil {
		info.Visibility = time.Duration(v) * time.Second
	}
	info.DeadLetter = deadLetterName(out.Attributes["RedrivePolicy"])
	info.MaxMessageSize = MaxMessageSize
	if v, err := strconv.Atoi(out.Attributes["MaximumMessageSize"]); err == nil && v > 0 {
		info.MaxMessageSize = v
	}
	return info, nil
}

// deadLetterName is the queue name of a redrive policy's
// deadLetterTargetArn (an ARN, or a bare name as some local servers
// write it); "" when it names none.
func deadLetterName(policy string) string {
	i := strings.Index(policy, `"deadLetterTargetArn"`)
	if i < 0 {
		return ""
	}
	rest := policy[i+len(`"deadLetterTargetArn"`):]
	rest = strings.TrimLeft(rest, " :")
	if !strings.HasPrefix(rest, `"`) {
		return ""
	}
	rest = rest[1:]
	end := strings.IndexByte(rest, '"')
	if end < 0 {
		return ""
	}
	arn := rest[:end]
	if j := strings.LastIndexByte(arn, ':'); j >= 0 {
		arn = arn[j+1:]
	}
	return arn
}

// Message is a message as received.
type Message struct {
	// Queue is the name of the queue it came from.
	Queue, QueueURL         string
	ID, ReceiptHandle, Body string
	// Attributes are its message attributes' values by name: the text of
	// a String or Number attribute, the bytes of a Binary one.
	Attributes map[string]string
	// AttributeTypes are their data types by name: "String", "Number" or
	// "Binary", with a custom suffix where the producer gave one
	// ("Number.int").
	AttributeTypes map[string]string
	// ReceiveCount is SQS's ApproximateReceiveCount (0: not reported).
	ReceiveCount int
	// GroupID is a FIFO message's group.
	GroupID string
	// Received is when this client received it.
	Received time.Time
}

// Receive takes up to n (at most MaxBatch) messages from the queue,
// waiting up to wait for the first (long polling), hidden for
// visibility.
func (c *Client) Receive(ctx context.Context, queue string, n int, wait, visibility time.Duration) ([]Message, error) {
	u, err := c.QueueURL(ctx, queue)
	if err != nil {
		return nil, err
	}
	in := &sqs.ReceiveMessageInput{QueueUrl: aws.String(u), MaxNumberOfMessages: int32(min(max(n, 1), MaxBatch)),
		WaitTimeSeconds: int32(min(wait, MaxWait) / time.Second), MessageAttributeNames: []string{"All"},
		AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameAll}}
	if visibility > 0 {
		in.VisibilityTimeout = int32(visibility / time.Second)
	}
	out, err := c.api.ReceiveMessage(ctx, in)
	if err != nil {
		return nil, fmt.Errorf("sqs: receive from %s: %w", queue, err)
	}
	now := time.Now()
	msgs := make([]Message, 0, len(out.Messages))
	for _, m := range out.Messages {
		msg := Message{Queue: queue, QueueURL: u, ID: aws.ToString(m.MessageId), ReceiptHandle: aws.ToString(m.ReceiptHandle),
			Body: aws.ToString(m.Body), Received: now, GroupID: m.Attributes["MessageGroupId"]}
		msg.ReceiveCount, _ = strconv.Atoi(m.Attributes["ApproximateReceiveCount"])
		if len(m.MessageAttributes) > 0 {
			msg.Attributes = make(map[string]string, len(m.MessageAttributes))
			msg.AttributeTypes = make(map[string]string, len(m.MessageAttributes))
			for k, v := range m.MessageAttributes {
				if v.StringValue != nil {
					msg.Attributes[k] = *v.StringValue
				} else {
					msg.Attributes[k] = string(v.BinaryValue)
				}
				msg.AttributeTypes[k] = aws.ToString(v.DataType)
				if msg.AttributeTypes[k] == "" {
					msg.AttributeTypes[k] = "String"
				}
			}
		}
		msgs = append(msgs, msg)
	}
	return msgs, nil
}

// NotFound reports whether err is the server's word that a queue does not
// exist.
func NotFound(err error) bool {
	var ae smithy.APIError
	if !errors.As(err, &ae) {
		return false
	}
	code := strings.ToLower(ae.ErrorCode())
	return strings.Contains(code, "nonexistentqueue") || strings.Contains(code, "queuedoesnotexist")
}

// gone reports whether err is the server's word that a receipt handle is
// not in flight (any more).
func gone(err error) bool {
	var ae smithy.APIError
	if !errors.As(err, &ae) {
		return false
	}
	code := strings.ToLower(ae.ErrorCode())
	return strings.Contains(code, "receipthandleisinvalid") || strings.Contains(code, "messagenotinflight") ||
		strings.Contains(code, "invalidparametervalue") && strings.Contains(strings.ToLower(ae.ErrorMessage()), "receipt handle")
}

// batchEntryError is the error of one failed entry of a batch call (op):
// ErrGone when the entry's receipt handle is not in flight (any more).
func batchEntryError(op string, f types.BatchResultErrorEntry) error {
	code := aws.ToString(f.Code)
	if c := strings.ToLower(code); strings.Contains(c, "receipthandle") || strings.Contains(c, "notinflight") {
		return fmt.Errorf("%w (%s)", ErrGone, code)
	}
	return fmt.Errorf("sqs: %s: %s: %s", op, code, aws.ToString(f.Message))
}

// Visibility is one message's new visibility timeout.
type Visibility struct {
	QueueURL, ReceiptHandle string
	Timeout                 time.Duration
}

// SetVisibility changes the visibility timeouts of the messages (0:
// visible again now), in batches per queue where the server has them. The
// result has one error per entry (nil: changed); an entry whose handle is
// not in flight has one wrapping ErrGone.
func (c *Client) SetVisibility(ctx context.Context, vs []Visibility) []error {
	errs := make([]error, len(vs))
	c.mu.Lock()
	single := c.noVisBatch
	c.mu.Unlock()
	if !single {
		// A batch entry's timeout of 0 is left out of the request by the
		// SDK (it takes 0 for unset): those go one call each.
		byQueue := map[string][]int{}
		var zeros []int
		for i, v := range vs {
			if v.Timeout < time.Second {
				zeros = append(zeros, i)
				continue
			}
			byQueue[v.QueueURL] = append(byQueue[v.QueueURL], i)
		}
		for _, i := range zeros {
			errs[i] = c.setVisibility(ctx, vs[i])
		}
		for u, idx := range byQueue {
			for len(idx) > 0 {
				n := min(len(idx), MaxBatch)
				part := idx[:n]
				idx = idx[n:]
				entries := make([]types.ChangeMessageVisibilityBatchRequestEntry, len(part))
				for k, i := range part {
					entries[k] = types.ChangeMessageVisibilityBatchRequestEntry{Id: aws.String(strconv.Itoa(k)),
						ReceiptHandle: aws.String(vs[i].ReceiptHandle), VisibilityTimeout: int32(vs[i].Timeout / time.Second)}
				}
				out, err := c.api.ChangeMessageVisibilityBatch(ctx, &sqs.ChangeMessageVisibilityBatchInput{QueueUrl: aws.String(u), Entries: entries})
				if err != nil {
					var ae smithy.APIError
					if errors.As(err, &ae) && ctx.Err() == nil && !single {
						// The server does not have the batch call (goaws):
						// one call each from now on.
						c.log.Info("SQS server refused ChangeMessageVisibilityBatch; changing visibility one message at a time",
							zap.String("code", ae.ErrorCode()))
						c.mu.Lock()
						c.noVisBatch = true
						c.mu.Unlock()
						for _, idx := range byQueue {
							for _, i := range idx {
								errs[i] = c.setVisibility(ctx, vs[i])
							}
						}
						return errs
					}
					for _, i := range part {
						errs[i] = fmt.Errorf("sqs: change visibility: %w", err)
					}
					continue
				}
				for _, f := range out.Failed {
					k, _ := strconv.Atoi(aws.ToString(f.Id))
					if k < 0 || k >= len(part) {
						continue
					}
					errs[part[k]] = batchEntryError("change visibility", f)
				}
			}
		}
		return errs
	}
	for i, v := range vs {
		errs[i] = c.setVisibility(ctx, v)
	}
	return errs
}

// setVisibility changes one message's visibility timeout.
func (c *Client) setVisibility(ctx context.Context, v Visibility) error {
	_, err := c.api.ChangeMessageVisibility(ctx, &sqs.ChangeMessageVisibilityInput{QueueUrl: aws.String(v.QueueURL),
		ReceiptHandle: aws.String(v.ReceiptHandle), VisibilityTimeout: int32(v.Timeout / time.Second)})
	if err != nil {
		if gone(err) {
			err = fmt.Errorf("%w: %v", ErrGone, err)
		}
		return fmt.Errorf("sqs: change visibility: %w", err)
	}
	return nil
}

// deleteReq is one delete waiting for its batch.
type deleteReq struct {
	queueURL, handle string
	done             chan error
}

// deleteLinger is how long a delete waits for others to share its batch.
const deleteLinger = 2 * time.Millisecond

// Delete deletes the message received under handle from the queue at
// queueURL, in a batch with other deletes of the moment
// (DeleteMessageBatch). A handle no longer in flight gives an error
// wrapping ErrGone where the server tells.
func (c *Client) Delete(ctx context.Context, queueURL, handle string) (err error) {
	r := deleteReq{queueURL: queueURL, handle: handle, done: make(chan error, 1)}
	defer func() {
		if recover() != nil { // closed
			err = errors.New("sqs: client closed")
		}
	}()
	select {
	case c.del <- r:
	case <-ctx.Done():
		return fmt.Errorf("sqs: delete: %w", ctx.Err())
	}
	select {
	case err := <-r.done:
		return err
	case <-ctx.Done():
		return fmt.Errorf("sqs: delete: %w", ctx.Err())
	}
}

// deleter sends the deletes in batches of up to MaxBatch per queue.
func (c *Client) deleter() {
	defer close(c.delDone)
	for {
		r, ok := <-c.del
		if !ok {
			return
		}
		batch := map[string][]deleteReq{r.queueURL: {r}}
		n := 1
		timer := time.NewTimer(deleteLinger)
	collect:
		for n < 4*MaxBatch {
			select {
			case r, ok := <-c.del:
				if !ok {
					break collect
				}
				batch[r.queueURL] = append(batch[r.queueURL], r)
				n++
			case <-timer.C:
				break collect
			}
		}
		timer.Stop()
		var wg sync.WaitGroup
		for u, rs := range batch {
			for len(rs) > 0 {
				k := min(len(rs), MaxBatch)
				part := rs[:k]
				rs = rs[k:]
				wg.Add(1)
				go func() {
					defer wg.Done()
					c.deleteBatch(u, part)
				}()
			}
		}
		wg.Wait()
	}
}

func (c *Client) deleteBatch(u string, rs []deleteReq) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	entries := make([]types.DeleteMessageBatchRequestEntry, len(rs))
	for i, r := range rs {
		entries[i] = types.DeleteMessageBatchRequestEntry{Id: aws.String(strconv.Itoa(i)), ReceiptHandle: aws.String(r.handle)}
	}
	out, err := c.api.DeleteMessageBatch(ctx, &sqs.DeleteMessageBatchInput{QueueUrl: aws.String(u), Entries: entries})
	if err != nil {
		for _, r := range rs {
			r.done <- fmt.Errorf("sqs: delete: %w", err)
		}
		return
	}
	errs := make([]error, len(rs))
	for _, f := range out.Failed {
		i, _ := strconv.Atoi(aws.ToString(f.Id))
		if i < 0 || i >= len(rs) {
			continue
		}
		errs[i] = batchEntryError("delete", f)
	}
	for i, r := range rs {
		r.done <- errs[i]
	}
}

// Outgoing is a message to send.
type Outgoing struct {
	Body string
	// Attributes are its message attributes' values by name (a Binary
	// attribute's bytes).
	Attributes map[string]string
	// AttributeTypes are their data types by name ("String" where none is
	// given); a type beginning with "Binary" sends the value as bytes.
	AttributeTypes map[string]string
	// Delay is the message's DelaySeconds (cut to MaxDelay; not on a FIFO
	// queue).
	Delay time.Duration
	// GroupID and DedupID are a FIFO queue's MessageGroupId and
	// MessageDeduplicationId (default: "default" and a new one).
	GroupID, DedupID string
}

// Send sends m to the queue at queueURL and returns its message id.
func (c *Client) Send(ctx context.Context, queueURL string, m Outgoing) (string, error) {
	in := &sqs.SendMessageInput{QueueUrl: aws.String(queueURL), MessageBody: aws.String(m.Body)}
	if len(m.Attributes) > 0 {
		in.MessageAttributes = make(map[string]types.MessageAttributeValue, len(m.Attributes))
		for k, v := range m.Attributes {
			dt := m.AttributeType(k)
			if IsBinary(dt) {
				in.MessageAttributes[k] = types.MessageAttributeValue{DataType: aws.String(dt), BinaryValue: []byte(v)}
			} else {
				in.MessageAttributes[k] = types.MessageAttributeValue{DataType: aws.String(dt), StringValue: aws.String(v)}
			}
		}
	}
	if strings.HasSuffix(queueURL, ".fifo") {
		g := m.GroupID
		if g == "" {
			g = "default"
		}
		d := m.DedupID
		if d == "" {
			d = celeryproto.NewTaskID()
		}
		in.MessageGroupId, in.MessageDeduplicationId = aws.String(g), aws.String(d)
	} else if m.Delay > 0 {
		in.DelaySeconds = int32(min(m.Delay, MaxDelay).Round(time.Second) / time.Second)
	}
	out, err := c.api.SendMessage(ctx, in)
	if err != nil {
		if refused(err) {
			return "", fmt.Errorf("sqs: send: %w: %w", ErrRefused, err)
		}
		return "", fmt.Errorf("sqs: send: %w", err)
	}
	return aws.ToString(out.MessageId), nil
}

// AttributeType is the data type of the attribute named name ("String"
// where none is given).
func (m *Outgoing) AttributeType(name string) string {
	if dt := m.AttributeTypes[name]; dt != "" {
		return dt
	}
	return "String"
}

// AttributeSize is what one attribute counts towards a message's size
// against a queue's MaximumMessageSize (with the body's length): its
// name, data type and value.
func AttributeSize(name, dataType, value string) int {
	return len(name) + len(dataType) + len(value)
}

// IsBinary reports whether an attribute's data type is Binary (or a
// custom Binary type): its value is bytes.
func IsBinary(dataType string) bool { return strings.HasPrefix(dataType, "Binary") }

// ValidText reports whether s is text SQS takes in a body or a String or
// Number attribute: the characters #x9, #xA, #xD, #x20 to #xD7FF, #xE000
// to #xFFFD and #x10000 to #x10FFFF, in UTF-8.
func ValidText(s string) bool {
	for i, r := range s {
		if !validRune(r) || r == utf8.RuneError && isBad(s[i:]) {
			return false
		}
	}
	return true
}

// ValidTextOf is s with each character SQS does not take (and each byte
// that is not UTF-8) replaced by U+FFFD.
func ValidTextOf(s string) string {
	if ValidText(s) {
		return s
	}
	var b strings.Builder
	for i, r := range s {
		if !validRune(r) || r == utf8.RuneError && isBad(s[i:]) {
			r = utf8.RuneError
		}
		b.WriteRune(r)
	}
	return b.String()
}

func validRune(r rune) bool {
	return r == 0x9 || r == 0xA || r == 0xD || r >= 0x20 && r <= 0xD7FF || r >= 0xE000 && r <= 0xFFFD ||
		r >= 0x10000 && r <= 0x10FFFF
}

// isBad reports whether s begins with a byte that is not UTF-8.
func isBad(s string) bool {
	r, n := utf8.DecodeRuneInString(s)
	return r == utf8.RuneError && n <= 1
}

// refused reports whether err is SQS's refusal of a send for what the
// message is (sending it again gives the same answer).
func refused(err error) bool {
	var ae smithy.APIError
	if !errors.As(err, &ae) {
		return false
	}
	code := strings.ToLower(ae.ErrorCode())
	for _, c := range []string{"invalidparametervalue", "invalidmessagecontents", "invalidattributename",
		"invalidattributevalue", "messagetoolong", "toomanyattributes", "unsupportedoperation"} {
		if strings.Contains(code, c) {
			return true
		}
	}
	return false
}
