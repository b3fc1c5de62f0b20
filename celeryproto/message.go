package celeryproto

import "time"

// Delivery is a received message as the broker hands it over.
type Delivery struct {
	ContentType, ContentEncoding string
	// Headers hold AMQP table values: string, bool, int8..int64, float32/64,
	// nil, []any, map[string]any, time.Time, []byte.
	Headers                map[string]any
	Body                   []byte
	CorrelationID, ReplyTo string
	Priority, DeliveryMode uint8
	Expiration             string
	Redelivered            bool
	// HeadersError, when set, says the transport received the message's
	// header table but could not read it (Headers is then nil). Decode
	// refuses such a delivery with ErrBadHeader.
	HeadersError error
}

// Limits bound what the decoder accepts and the memory one decode takes. A
// message past a limit is refused with ErrTooLarge.
type Limits struct {
	// MaxBodyBytes is the largest body accepted, before and after
	// decompression (the decompression bomb guard). Default 16 MiB.
	MaxBodyBytes int
	// MaxDecodedBytes bounds the decoded values of one body: each element
	// (list, mapping, key, string, number, ...) is charged ElementCost
	// bytes plus its text, as it is decoded, so that a small body of many
	// tiny elements cannot take gigabytes of heap. Default 64 MiB.
	MaxDecodedBytes int
	// MaxElements bounds the elements of one decoded body. Default 1 Mi
	// (1,048,576).
	MaxElements int
}

// DefaultMaxBodyBytes is the default Limits.MaxBodyBytes.
const DefaultMaxBodyBytes = 16 << 20

// Message is one decoded Celery task message, whatever its protocol.
type Message struct {
	Protocol int // 1 or 2
	Task, ID string
	// Args and Kwargs hold nil, bool, int64, float64, string, []byte,
	// time.Time, []any and map[string]any values.
	Args   []any
	Kwargs map[string]any
	// Callbacks and Errbacks are embed.callbacks / embed.errbacks (link / link_error).
	Callbacks, Errbacks []Signature
	// Chain lists the remaining steps as on the wire: the next step is the last element.
	Chain []Signature
	Chord *Signature
	// ETA and Expires are zero when absent.
	ETA, Expires              time.Time
	Retries                   int
	TimeLimit                 TimeLimit
	RootID, ParentID, GroupID string
	GroupIndex                *int
	Shadow                    string
	IgnoreResult              bool
	ReplyTo, CorrelationID    string
	Origin                    string
	// ArgsRepr and KwargsRepr are Python reprs; they may hold secrets: do not log them.
	ArgsRepr, KwargsRepr string
	Stamps               map[string]any
	StampedHeaders       []string
	// Headers holds the headers not listed above, e.g. "idempotency_key".
	Headers                                   map[string]any
	ContentType, ContentEncoding, Compression string
	Priority                                  uint8
}

// Serializer names the serializer m came in ("json", "msgpack" or "yaml";
// "json" when its content type names none of them), for the messages sent
// on its behalf (chain steps, callbacks, retries): a Python worker sends
// those with its own task_serializer, which the caller's is a proxy for.
func (m *Message) Serializer() string {
	if s, err := serializerFor(m.ContentType); err == nil {
		return s
	}
	return "json"
}

// TimeLimit is a task's hard and soft time limit; 0 means none. On the wire
// the order is [hard, soft].
type TimeLimit struct{ Hard, Soft time.Duration }

// Signature is a task signature as found in embed callbacks, errbacks, chain and chord.
type Signature struct {
	Task        string
	Args        []any
	Kwargs      map[string]any
	Options     map[string]any
	SubtaskType string
	Immutable   bool
}

// TaskID returns options.task_id, or "" when the signature is not frozen.
func (s Signature) TaskID() string {
	v, _ := s.Options["task_id"].(string)
	return v
}

// ReplyTo returns options.reply_to, or "".
func (s Signature) ReplyTo() string {
	v, _ := s.Options["reply_to"].(string)
	return v
}
