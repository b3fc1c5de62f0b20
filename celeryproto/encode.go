package celeryproto

import (
	"fmt"
	"strconv"
	"time"

	"github.com/vmihailenco/msgpack/v5"
	yaml "go.yaml.in/yaml/v3"
)

// Publishing is what to hand to the broker.
type Publishing struct {
	ContentType, ContentEncoding string
	Headers                      map[string]any
	Body                         []byte
	CorrelationID, ReplyTo       string
	DeliveryMode, Priority       uint8
	// Expiration is the per-message TTL in milliseconds, as a string ("" = none).
	Expiration string
}

// EncodeOptions choose how EncodeTask writes a message.
type EncodeOptions struct {
	// Protocol is 2 (the default) or 1.
	Protocol int
	// Serializer is "json" (the default), "msgpack" or "yaml".
	Serializer string
	// Compression is "" (none) or a compression name or alias: zlib/gzip,
	// xz/lzma, brotli, zstd. (bzip2 is decoded but cannot be encoded.)
	Compression string
	// Now is the clock for the expiration property; nil means time.Now.
	Now func() time.Time
}

// EncodeTask writes m as a Celery task message (for retries, chain steps,
// callbacks and errbacks) that Celery 5.2 accepts. Protocol 2 puts the task
// fields in headers and [args, kwargs, embed] in the body; protocol 1 puts
// everything in a body mapping. m.Headers are sent as extra headers.
func EncodeTask(m *Message, o EncodeOptions) (*Publishing, error) {
	if m == nil || m.Task == "" || m.ID == "" {
		return nil, fmt.Errorf("celeryproto: encode task: task name and id are required")
	}
	ser := o.Serializer
	if ser == "" {
		ser = "json"
	}
	p := &Publishing{
		CorrelationID: m.ID, ReplyTo: m.ReplyTo, DeliveryMode: 2, Priority: m.Priority,
		Headers: make(map[string]any, 20+len(m.Headers)),
	}
	for k, v := range m.Headers {
		p.Headers[k] = v
	}
	args := m.Args
	if args == nil {
		args = []any{}
	}
	kwargs := m.Kwargs
	if kwargs == nil {
		kwargs = map[string]any{}
	}
	var body any
	switch o.Protocol {
	case 0, 2:
		h := p.Headers
		h["lang"] = "py"
		h["task"] = m.Task
		h["id"] = m.ID
		h["shadow"] = orNil(m.Shadow)
		h["eta"] = timeOrNil(m.ETA)
		h["expires"] = timeOrNil(m.Expires)
		h["group"] = orNil(m.GroupID)
		h["group_index"] = intPtrOrNil(m.GroupIndex)
		h["retries"] = int64(m.Retries)
		h["timelimit"] = []any{limitValue(m.TimeLimit.Hard), limitValue(m.TimeLimit.Soft)}
		h["root_id"] = orNil(m.RootID)
		h["parent_id"] = orNil(m.ParentID)
		h["argsrepr"] = m.ArgsRepr
		h["kwargsrepr"] = m.KwargsRepr
		h["origin"] = orNil(m.Origin)
		h["ignore_result"] = m.IgnoreResult
		if m.Stamps != nil {
			h["stamps"] = m.Stamps
		}
		if m.StampedHeaders != nil {
			h["stamped_headers"] = m.StampedHeaders
		}
		body = []any{args, kwargs, map[string]any{
			"callbacks": sigList(m.Callbacks), "errbacks": sigList(m.Errbacks),
			"chain": sigList(m.Chain), "chord": sigPtr(m.Chord),
		}}
	case 1:
		body = map[string]any{
			"task": m.Task, "id": m.ID, "args": args, "kwargs": kwargs,
			"group": orNil(m.GroupID), "group_index": intPtrOrNil(m.GroupIndex),
			"retries": int64(m.Retries), "eta": timeOrNil(m.ETA), "expires": timeOrNil(m.Expires),
			"utc": true, "callbacks": sigList(m.Callbacks), "errbacks": sigList(m.Errbacks),
			"timelimit": []any{limitValue(m.TimeLimit.Hard), limitValue(m.TimeLimit.Soft)},
			"taskset":   orNil(m.GroupID), "chord": sigPtr(m.Chord),
		}
	default:
		return nil, fmt.Errorf("celeryproto: encode task: unsupported protocol %d", o.Protocol)
	}
	var err error
	if p.ContentType, p.ContentEncoding, p.Body, err = marshal(ser, body); err != nil {
		return nil, fmt.Errorf("celeryproto: encode task %s: %w", m.Task, err)
	}
	if o.Compression != "" {
		kind, out, err := compress(o.Compression, p.Body)
		if err != nil {
			return nil, err
		}
		p.Body = out
		p.Headers["compression"] = kind
	}
	if !m.Expires.IsZero() {
		now := time.Now
		if o.Now != nil {
			now = o.Now
		}
		ms := max(m.Expires.Sub(now()).Milliseconds(), 0)
		p.Expiration = strconv.FormatInt(ms, 10)
	}
	return p, nil
}

// Serializers are the serializers EncodeTask and EncodeResult write (and
// the decoder reads, besides refusing pickle).
var Serializers = []string{"json", "msgpack", "yaml"}

// marshal serializes v and returns the content type and encoding to send.
func marshal(serializer string, v any) (contentType, encoding string, body []byte, err error) {
	switch serializer {
	case "json":
		body, err = appendJSONValue(make([]byte, 0, 512), v, 0)
		return ContentTypeJSON, "utf-8", body, err
	case "msgpack":
		w, err := wireValue(v, 0)
		if err != nil {
			return "", "", nil, err
		}
		body, err = msgpack.Marshal(w)
		return ContentTypeMsgpack, "binary", body, err
	case "yaml":
		w, err := wireValue(v, 0)
		if err != nil {
			return "", "", nil, err
		}
		body, err = yaml.Marshal(w)
		return ContentTypeYAML, "utf-8", body, err
	}
	return "", "", nil, fmt.Errorf("unsupported serializer %q (json, msgpack or yaml)", serializer)
}

// wireValue prepares v for msgpack and YAML: times become FormatTime strings
// (as kombu 5.2 sends them) and signatures become mappings.
func wireValue(v any, depth int) (any, error) {
	if depth > maxDepth {
		return nil, fmt.Errorf("value nested deeper than %d", maxDepth)
	}
	switch x := v.(type) {
	case time.Time:
		return FormatTime(x), nil
	case Signature:
		return wireValue(x.wire(), depth)
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			w, err := wireValue(e, depth+1)
			if err != nil {
				return nil, err
			}
			out[i] = w
		}
		return out, nil
	case map[string]any:
		out := make(map[string]any, len(x))
		for k, e := range x {
			w, err := wireValue(e, depth+1)
			if err != nil {
				return nil, err
			}
			out[k] = w
		}
		return out, nil
	}
	return v, nil
}

func (s Signature) wire() map[string]any {
	args, kwargs, opts := s.Args, s.Kwargs, s.Options
	if args == nil {
		args = []any{}
	}
	if kwargs == nil {
		kwargs = map[string]any{}
	}
	if opts == nil {
		opts = map[string]any{}
	}
	return map[string]any{
		"task": s.Task, "args": args, "kwargs": kwargs, "options": opts,
		"subtask_type": orNil(s.SubtaskType), "immutable": s.Immutable,
	}
}

func sigList(s []Signature) any {
	if s == nil {
		return nil
	}
	out := make([]any, len(s))
	for i, e := range s {
		out[i] = e.wire()
	}
	return out
}

func sigPtr(s *Signature) any {
	if s == nil {
		return nil
	}
	return s.wire()
}

func orNil(s string) any {
	if s == "" {
		return nil
	}
	return s
}

func timeOrNil(t time.Time) any {
	if t.IsZero() {
		return nil
	}
	return FormatTime(t)
}

func intPtrOrNil(p *int) any {
	if p == nil {
		return nil
	}
	return int64(*p)
}

// limitValue writes a time limit in seconds: an integer when whole, else a
// float; nil when unset.
func limitValue(d time.Duration) any {
	if d <= 0 {
		return nil
	}
	if d%time.Second == 0 {
		return int64(d / time.Second)
	}
	return d.Seconds()
}
