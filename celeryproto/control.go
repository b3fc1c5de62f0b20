package celeryproto

import (
	"fmt"
	"math"
	"strings"
	"time"
)

// ControlRequest is a remote-control (pidbox) request as kombu's Mailbox
// publishes it for `celery inspect` and `celery control`.
type ControlRequest struct {
	// Method is the command name, e.g. "ping", "revoke".
	Method string
	// Arguments are the command's keyword arguments (never nil).
	Arguments map[string]any
	// Destination lists the node names the request is for; empty means all.
	Destination []string
	// Pattern and Matcher select nodes by name when Destination is empty
	// (matcher "glob" or "pcre").
	Pattern, Matcher string
	// Ticket identifies the call; replies carry it in their headers.
	Ticket string
	// ReplyExchange and ReplyRoutingKey say where to reply; both empty for a
	// request that expects no reply (a cast).
	ReplyExchange, ReplyRoutingKey string
	// Clock is the sender's Lamport clock (header clock), 0 if absent.
	Clock int64
	// Expires is when the sender stops waiting (header expires); zero if
	// absent or 0.
	Expires time.Time
}

// WantsReply reports whether the request expects a reply.
func (r *ControlRequest) WantsReply() bool { return r.ReplyExchange != "" || r.ReplyRoutingKey != "" }

// DecodeControl decodes a pidbox request. Only JSON is accepted, as kombu's
// Mailbox does; pickle is refused with ErrPickle. Numbers in Arguments are
// int64 when integral and float64 otherwise.
func DecodeControl(d *Delivery) (*ControlRequest, error) {
	ct := strings.ToLower(strings.TrimSpace(d.ContentType))
	switch ct {
	case "application/json", "":
	case "application/x-python-serialize":
		return nil, ctlError("control message is pickle: refused", ErrPickle)
	default:
		return nil, ctlError(fmt.Sprintf("unsupported content type %q for a control message", d.ContentType), ErrUnsupportedContentType)
	}
	if c, ok := d.Headers["compression"]; ok && c != nil {
		return nil, ctlError(fmt.Sprintf("compressed control messages are not supported (%v)", c), ErrCompression)
	}
	v, err := decodeJSON(&defaultDecoder.scratch, d.Body, nil)
	raw, isObject := v.(map[string]any)
	if err != nil {
		return nil, ctlError("control body is not a JSON object: "+err.Error(), ErrMalformed)
	}
	if !isObject && v != nil { // null reads as no fields, as before: no method
		return nil, ctlError(fmt.Sprintf("control body is not a JSON object: got %T", v), ErrMalformed)
	}
	req := &ControlRequest{Arguments: map[string]any{}}
	var ok bool
	if req.Method, ok = raw["method"].(string); !ok || req.Method == "" {
		return nil, ctlError("control body has no method", ErrShape)
	}
	switch a := raw["arguments"].(type) {
	case nil:
	case map[string]any:
		for k, v := range a {
			req.Arguments[k] = v
		}
	default:
		return nil, ctlError(fmt.Sprintf("control arguments must be an object, got %T", a), ErrShape)
	}
	switch dst := raw["destination"].(type) {
	case nil:
	case string: // tolerated: a single name
		req.Destination = []string{dst}
	case []any:
		for _, n := range dst {
			s, ok := n.(string)
			if !ok {
				return nil, ctlError(fmt.Sprintf("control destination must list strings, got %T", n), ErrShape)
			}
			req.Destination = append(req.Destination, s)
		}
	default:
		return nil, ctlError(fmt.Sprintf("control destination must be a list, got %T", dst), ErrShape)
	}
	req.Pattern, _ = raw["pattern"].(string)
	req.Matcher, _ = raw["matcher"].(string)
	req.Ticket, _ = raw["ticket"].(string)
	switch rt := raw["reply_to"].(type) {
	case nil:
	case map[string]any:
		req.ReplyExchange, _ = rt["exchange"].(string)
		req.ReplyRoutingKey, _ = rt["routing_key"].(string)
	default:
		return nil, ctlError(fmt.Sprintf("control reply_to must be an object, got %T", rt), ErrShape)
	}
	req.Clock = ctlHeaderInt(d.Headers["clock"])
	if f := ctlHeaderFloat(d.Headers["expires"]); f > 0 {
		sec, frac := math.Modf(f)
		req.Expires = time.Unix(int64(sec), int64(frac*1e9)).UTC()
	}
	return req, nil
}

// EncodeControlReply encodes the reply of node to a pidbox request: body
// {"<node>": result}, headers ticket and clock, JSON, transient, as kombu's
// Node.reply publishes it.
func EncodeControlReply(node string, result any, ticket string, clock int64) (*Publishing, error) {
	if node == "" {
		return nil, fmt.Errorf("encode control reply: empty node name")
	}
	body, err := appendEventJSON(make([]byte, 0, 128), map[string]any{node: result})
	if err != nil {
		return nil, fmt.Errorf("encode control reply: %w", err)
	}
	var t any
	if ticket != "" {
		t = ticket
	}
	return &Publishing{
		ContentType:     eventContentType,
		ContentEncoding: eventContentEncoding,
		Headers:         map[string]any{"ticket": t, "clock": clock},
		Body:            body,
		DeliveryMode:    eventDeliveryMode,
	}, nil
}

func ctlError(detail string, reason error) error {
	return &DecodeError{Reason: reason, Detail: detail}
}

func ctlHeaderInt(v any) int64 {
	switch x := v.(type) {
	case int64:
		return x
	case int32:
		return int64(x)
	case int16:
		return int64(x)
	case int8:
		return int64(x)
	case int:
		return int64(x)
	case uint8:
		return int64(x)
	case uint16:
		return int64(x)
	case uint32:
		return int64(x)
	case float64:
		return int64(x)
	case float32:
		return int64(x)
	}
	return 0
}

func ctlHeaderFloat(v any) float64 {
	switch x := v.(type) {
	case float64:
		return x
	case float32:
		return float64(x)
	}
	return float64(ctlHeaderInt(v))
}
