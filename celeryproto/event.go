package celeryproto

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// Event and remote-control messages are always JSON: Celery's event
// dispatcher uses the event_serializer (json by default) and kombu's
// mailbox accepts json only.
const (
	eventContentType     = "application/json"
	eventContentEncoding = "utf-8"
	// transient delivery, as Celery sends events and control replies
	eventDeliveryMode = 1
)

// EventMultiRoutingKey is the routing key of a message that carries a list of
// task events, as Celery's own worker sends buffered task events
// ("task.multi"); celery.events.EventReceiver reads each element.
const EventMultiRoutingKey = "task.multi"

// EncodeEvent encodes one Celery event for the celeryev exchange: a JSON
// object with the given fields, delivery mode 1 (transient) and the header
// hostname, exactly as celery.events.EventDispatcher publishes it. fields must
// hold "type" and "hostname" strings; Celery's readers also expect pid, clock,
// timestamp and utcoffset.
func EncodeEvent(fields map[string]any) (*Publishing, error) {
	host, err := eventHost(fields)
	if err != nil {
		return nil, err
	}
	body, err := appendEventJSON(make([]byte, 0, 256), fields)
	if err != nil {
		return nil, fmt.Errorf("encode event %v: %w", fields["type"], err)
	}
	return eventPublishing(host, body), nil
}

// EncodeEvents encodes several events into one message whose body is a JSON
// list of event objects, the form Celery's worker uses for buffered task
// events (routing key EventMultiRoutingKey). The hostname header is taken
// from the first event. It is an error to pass no events.
func EncodeEvents(events []map[string]any) (*Publishing, error) {
	if len(events) == 0 {
		return nil, errors.New("encode events: no events")
	}
	host, err := eventHost(events[0])
	if err != nil {
		return nil, err
	}
	body := make([]byte, 0, 256*len(events))
	body = append(body, '[')
	for i, ev := range events {
		if _, err := eventHost(ev); err != nil {
			return nil, err
		}
		if i > 0 {
			body = append(body, ',')
		}
		if body, err = appendEventJSON(body, ev); err != nil {
			return nil, fmt.Errorf("encode event %v: %w", ev["type"], err)
		}
	}
	body = append(body, ']')
	return eventPublishing(host, body), nil
}

// EventStamp holds the fields every Celery event carries.
type EventStamp struct {
	Type, Hostname string
	PID            int
	Clock          int64
	Timestamp      float64 // Unix seconds
	UTCOffset      int     // hours west of UTC, as Celery's utcoffset()
}

// AppendEvent appends one event as a JSON object to dst: the stamp's fields,
// then the other fields (a key of the stamp in fields is ignored; "timestamp"
// in fields replaces the stamp's). It is the allocation-light form of
// EncodeEvent for a publisher that batches events itself; fields' keys are
// not sorted.
func AppendEvent(dst []byte, s EventStamp, fields map[string]any) ([]byte, error) {
	b, err := appendStamp(dst, s)
	if err != nil {
		return dst, err
	}
	ts := s.Timestamp
	for k, v := range fields {
		switch k {
		case "type", "hostname", "pid", "clock", "utcoffset":
			continue
		case "timestamp":
			if f, ok := v.(float64); ok {
				ts = f
			}
			continue
		}
		b = append(b, ',')
		b = appendEventString(b, k)
		b = append(b, ':')
		if b, err = appendEventJSON(b, v); err != nil {
			return dst, fmt.Errorf("append event %s: field %q: %w", s.Type, k, err)
		}
	}
	b = append(b, `,"timestamp":`...)
	if b, err = appendEventFloat(b, ts); err != nil {
		return dst, fmt.Errorf("append event %s: timestamp: %w", s.Type, err)
	}
	return append(b, '}'), nil
}

// appendStamp opens an event object with the stamp's fields but the
// timestamp (which closes it).
func appendStamp(dst []byte, s EventStamp) ([]byte, error) {
	if s.Type == "" || s.Hostname == "" {
		return dst, errors.New("append event: type and hostname are required")
	}
	b := append(dst, `{"type":`...)
	b = appendEventString(b, s.Type)
	b = append(b, `,"hostname":`...)
	b = appendEventString(b, s.Hostname)
	b = append(b, `,"pid":`...)
	b = strconv.AppendInt(b, int64(s.PID), 10)
	b = append(b, `,"clock":`...)
	b = strconv.AppendInt(b, s.Clock, 10)
	b = append(b, `,"utcoffset":`...)
	b = strconv.AppendInt(b, int64(s.UTCOffset), 10)
	return b, nil
}

// EventPublishing wraps an encoded event body (an object, or a list of
// objects for EventMultiRoutingKey) as Celery publishes events.
func EventPublishing(hostname string, body []byte) *Publishing {
	return eventPublishing(hostname, body)
}

// EventRoutingKey returns the celeryev routing key of an event type: the
// dashes become dots ("task-succeeded" -> "task.succeeded").
func EventRoutingKey(eventType string) string {
	return strings.ReplaceAll(eventType, "-", ".")
}

func eventHost(fields map[string]any) (string, error) {
	typ, _ := fields["type"].(string)
	if typ == "" {
		return "", errors.New("encode event: field type must be a non-empty string")
	}
	host, _ := fields["hostname"].(string)
	if host == "" {
		return "", fmt.Errorf("encode event %s: field hostname must be a non-empty string", typ)
	}
	return host, nil
}

func eventPublishing(host string, body []byte) *Publishing {
	return &Publishing{
		ContentType:     eventContentType,
		ContentEncoding: eventContentEncoding,
		Headers:         map[string]any{"hostname": host},
		Body:            body,
		DeliveryMode:    eventDeliveryMode,
	}
}

// appendEventJSON appends v as JSON. Maps are written with sorted keys. The
// common value types are written directly (events are encoded for every task
// when events are on); anything else goes through encoding/json.
func appendEventJSON(b []byte, v any) ([]byte, error) {
	switch x := v.(type) {
	case nil:
		return append(b, "null"...), nil
	case string:
		return appendEventString(b, x), nil
	case bool:
		return strconv.AppendBool(b, x), nil
	case int:
		return strconv.AppendInt(b, int64(x), 10), nil
	case int32:
		return strconv.AppendInt(b, int64(x), 10), nil
	case int64:
		return strconv.AppendInt(b, x, 10), nil
	case uint32:
		return strconv.AppendUint(b, uint64(x), 10), nil
	case uint64:
		return strconv.AppendUint(b, x, 10), nil
	case float64:
		return appendEventFloat(b, x)
	case float32:
		return appendEventFloat(b, float64(x))
	case time.Time:
		return appendEventString(b, FormatTime(x)), nil
	case []string:
		b = append(b, '[')
		for i, s := range x {
			if i > 0 {
				b = append(b, ',')
			}
			b = appendEventString(b, s)
		}
		return append(b, ']'), nil
	case []any:
		b = append(b, '[')
		for i, e := range x {
			if i > 0 {
				b = append(b, ',')
			}
			var err error
			if b, err = appendEventJSON(b, e); err != nil {
				return nil, err
			}
		}
		return append(b, ']'), nil
	case map[string]any:
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		b = append(b, '{')
		for i, k := range keys {
			if i > 0 {
				b = append(b, ',')
			}
			b = appendEventString(b, k)
			b = append(b, ':')
			var err error
			if b, err = appendEventJSON(b, x[k]); err != nil {
				return nil, fmt.Errorf("field %q: %w", k, err)
			}
		}
		return append(b, '}'), nil
	default:
		raw, err := json.Marshal(v)
		if err != nil {
			return nil, err
		}
		return append(b, raw...), nil
	}
}

func appendEventFloat(b []byte, f float64) ([]byte, error) {
	// As Python's json.dumps (kombu's) writes them, and json.loads reads.
	switch {
	case math.IsNaN(f):
		return append(b, "NaN"...), nil
	case math.IsInf(f, 1):
		return append(b, "Infinity"...), nil
	case math.IsInf(f, -1):
		return append(b, "-Infinity"...), nil
	}
	if f == math.Trunc(f) && math.Abs(f) < 1e15 {
		// keep it a float for Python readers: 2 -> 2.0
		b = strconv.AppendFloat(b, f, 'f', -1, 64)
		return append(b, ".0"...), nil
	}
	if a := math.Abs(f); a >= 1e-6 && a < 1e21 {
		return strconv.AppendFloat(b, f, 'f', -1, 64), nil
	}
	return strconv.AppendFloat(b, f, 'g', -1, 64), nil
}

const eventHex = "0123456789abcdef"

// appendEventString writes s as a JSON string, escaping as encoding/json
// does (including <, > and & and invalid UTF-8 as U+FFFD).
func appendEventString(b []byte, s string) []byte {
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' && c != '<' && c != '>' && c != '&' {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '"', '\\':
				b = append(b, '\\', c)
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			default:
				b = append(b, '\\', 'u', '0', '0', eventHex[c>>4], eventHex[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, s[start:i]...)
			b = append(b, `\ufffd`...)
			i += size
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			b = append(b, s[start:i]...)
			b = append(b, '\\', 'u', '2', '0', '2', eventHex[r&0xf])
			i += size
			start = i
			continue
		}
		i += size
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}
