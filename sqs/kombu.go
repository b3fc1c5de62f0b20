package sqs

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strings"

	"github.com/onceler/onceler/celeryproto"
)

// kombuEnvelope is a message as kombu's virtual transports write it, the
// body of an SQS message of Celery (base64-encoded as a whole by default:
// sqs_base64_encoding).
type kombuEnvelope struct {
	Body            string          `json:"body"`
	ContentEncoding string          `json:"content-encoding"`
	ContentType     string          `json:"content-type"`
	Headers         json.RawMessage `json:"headers"`
	Properties      kombuProperties `json:"properties"`
}

type kombuProperties struct {
	CorrelationID string            `json:"correlation_id,omitempty"`
	ReplyTo       string            `json:"reply_to,omitempty"`
	DeliveryMode  uint8             `json:"delivery_mode,omitempty"`
	DeliveryInfo  kombuDeliveryInfo `json:"delivery_info"`
	Priority      uint8             `json:"priority"`
	BodyEncoding  string            `json:"body_encoding,omitempty"`
	DeliveryTag   string            `json:"delivery_tag,omitempty"`
	// MessageGroupID is kombu's MessageGroupId property of a FIFO queue's
	// message.
	MessageGroupID string `json:"MessageGroupId,omitempty"`
}

type kombuDeliveryInfo struct {
	Exchange   string `json:"exchange"`
	RoutingKey string `json:"routing_key"`
}

// Kombu is a Celery message read from kombu's envelope.
type Kombu struct {
	Delivery   celeryproto.Delivery
	RoutingKey string
}

// ErrNotKombu is DecodeKombu's error for a body that is not kombu's
// envelope (a plain message).
var ErrNotKombu = errors.New("sqs: not a kombu message")

// DecodeKombu reads body as kombu's SQS transport writes a message: its
// JSON envelope, base64-encoded or not (kombu reads both). ErrNotKombu: the
// body is no such envelope; any other error: it is one, but broken.
func DecodeKombu(body string) (*Kombu, error) {
	raw := []byte(body)
	if b, err := base64.StdEncoding.DecodeString(strings.TrimSpace(body)); err == nil {
		raw = b
	}
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || raw[0] != '{' {
		return nil, ErrNotKombu
	}
	if !isEnvelope(raw) {
		return nil, ErrNotKombu
	}
	var env kombuEnvelope
	if err := json.Unmarshal(raw, &env); err != nil {
		return nil, fmt.Errorf("sqs: kombu envelope: %w", err)
	}
	k := &Kombu{RoutingKey: env.Properties.DeliveryInfo.RoutingKey}
	d := &k.Delivery
	d.ContentType, d.ContentEncoding = env.ContentType, env.ContentEncoding
	d.CorrelationID, d.ReplyTo = env.Properties.CorrelationID, env.Properties.ReplyTo
	d.Priority, d.DeliveryMode = env.Properties.Priority, env.Properties.DeliveryMode
	d.Body = []byte(env.Body)
	if env.Properties.BodyEncoding == "base64" {
		b, err := base64.StdEncoding.DecodeString(env.Body)
		if err != nil {
			return nil, fmt.Errorf("sqs: kombu body: %w", err)
		}
		d.Body = b
	}
	if len(env.Headers) > 0 && !bytes.Equal(env.Headers, []byte("null")) {
		dec := json.NewDecoder(bytes.NewReader(env.Headers))
		dec.UseNumber()
		var h map[string]any
		if err := dec.Decode(&h); err != nil {
			d.HeadersError = fmt.Errorf("sqs: kombu headers: %w", err)
		} else {
			d.Headers = tableValues(h).(map[string]any)
		}
	}
	return k, nil
}

// isEnvelope reports whether raw, a JSON object, has the form of kombu's
// envelope (virtual Channel.prepare_message and _inplace_augment_message):
// "body" a string, "content-type" a string, and "properties" an object
// with a "delivery_info" object (kombu's SQS transport itself takes a JSON
// object without properties.delivery_info for a body of its own, not an
// envelope). A plain message's keyword arguments named body and
// properties are not one.
func isEnvelope(raw []byte) bool {
	var probe struct {
		Body        *json.RawMessage `json:"body"`
		ContentType *json.RawMessage `json:"content-type"`
		Properties  *json.RawMessage `json:"properties"`
	}
	if json.Unmarshal(raw, &probe) != nil || probe.Body == nil || probe.ContentType == nil || probe.Properties == nil {
		return false
	}
	var s string
	if json.Unmarshal(*probe.Body, &s) != nil || json.Unmarshal(*probe.ContentType, &s) != nil {
		return false
	}
	var props map[string]json.RawMessage
	if json.Unmarshal(*probe.Properties, &props) != nil || props == nil {
		return false
	}
	var info map[string]json.RawMessage
	di, ok := props["delivery_info"]
	return ok && json.Unmarshal(di, &info) == nil && info != nil
}

// tableValues is v decoded from JSON with each number as the AMQP table
// value the decoder reads (int64 when integral, else float64).
func tableValues(v any) any {
	switch x := v.(type) {
	case json.Number:
		if i, err := x.Int64(); err == nil {
			return i
		}
		f, _ := x.Float64()
		return f
	case []any:
		for i, e := range x {
			x[i] = tableValues(e)
		}
		return x
	case map[string]any:
		for k, e := range x {
			x[k] = tableValues(e)
		}
		return x
	}
	return v
}

// EncodeKombu writes p as kombu's SQS transport does: the JSON envelope,
// its body base64-encoded, the whole base64-encoded; routingKey is the
// delivery_info's routing key (the queue's name, as Celery routes).
func EncodeKombu(p *celeryproto.Publishing, routingKey string) (string, error) {
	h := p.Headers
	if h == nil {
		h = map[string]any{}
	}
	hj, err := json.Marshal(jsonValues(h))
	if err != nil {
		return "", fmt.Errorf("sqs: kombu headers: %w", err)
	}
	env := kombuEnvelope{
		Body: base64.StdEncoding.EncodeToString(p.Body), ContentEncoding: p.ContentEncoding, ContentType: p.ContentType,
		Headers: hj,
		Properties: kombuProperties{CorrelationID: p.CorrelationID, ReplyTo: p.ReplyTo, DeliveryMode: max(p.DeliveryMode, 2),
			DeliveryInfo: kombuDeliveryInfo{RoutingKey: routingKey}, Priority: p.Priority, BodyEncoding: "base64", DeliveryTag: celeryproto.NewTaskID()},
	}
	b, err := json.Marshal(env)
	if err != nil {
		return "", fmt.Errorf("sqs: kombu envelope: %w", err)
	}
	return base64.StdEncoding.EncodeToString(b), nil
}

// jsonValues is an AMQP table value in a form encoding/json writes as
// kombu's JSON would ([]byte as text, non-finite floats as null).
func jsonValues(v any) any {
	switch x := v.(type) {
	case []byte:
		return string(x)
	case float64:
		if math.IsNaN(x) || math.IsInf(x, 0) {
			return nil
		}
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			out[i] = jsonValues(e)
		}
		return out
	case map[string]any:
		out := make(map[string]any, len(x))
		for k, e := range x {
			out[k] = jsonValues(e)
		}
		return out
	}
	return v
}
