package celeryproto

import (
	"fmt"
	"strings"
)

// ChordPart is one header part's entry in a chord's join list (the Redis
// sorted set celery-taskset-meta-<group id>.j): Celery's RedisBackend
// on_chord_part_return stores encode([1, task_id, state, result]), the
// result being the exception mapping for an exception state.
type ChordPart struct {
	TaskID string
	State  State
	// Value is the part's result, or its exception mapping as stored
	// ({"exc_type", "exc_message", "exc_module"}) for FAILURE, RETRY and
	// REVOKED.
	Value any
}

// EncodeChordPart writes r as its chord join entry in r.Serializer (json by
// default): [1, task_id, state, result], as Celery's
// RedisBackend.on_chord_part_return encodes it.
func EncodeChordPart(r *Result) ([]byte, error) {
	if r == nil || r.TaskID == "" || r.Status == "" {
		return nil, fmt.Errorf("celeryproto: encode chord part: task id and status are required")
	}
	ser := r.Serializer
	if ser == "" {
		ser = "json"
	}
	_, _, b, err := marshal(ser, []any{int64(1), r.TaskID, string(r.Status), r.resultValue()})
	if err != nil {
		return nil, fmt.Errorf("celeryproto: encode chord part of %s: %w", r.TaskID, err)
	}
	return b, nil
}

// DecodeChordPart reads a chord join entry written in serializer (json,
// msgpack or yaml; Celery's result_serializer) by onceler or by a Python
// Celery worker, within the default limits.
func DecodeChordPart(serializer string, data []byte) (*ChordPart, error) {
	if serializer == "" {
		serializer = "json"
	}
	v, err := defaultDecoder.unmarshal(serializer, data, newMeter(defaultDecoder.limits))
	if err != nil {
		return nil, fmt.Errorf("celeryproto: decode chord part: %w", err)
	}
	l, ok := v.([]any)
	if !ok || len(l) != 4 {
		return nil, fmt.Errorf("celeryproto: decode chord part: not a [1, task_id, state, result] list")
	}
	tid, _ := l[1].(string)
	st, _ := l[2].(string)
	if tid == "" || st == "" {
		return nil, fmt.Errorf("celeryproto: decode chord part: no task id or state")
	}
	return &ChordPart{TaskID: tid, State: State(st), Value: l[3]}, nil
}

// Propagates reports whether the part's state fails the chord: Celery's
// PROPAGATE_STATES, FAILURE and REVOKED.
func (p *ChordPart) Propagates() bool {
	return p.State == StateFailure || p.State == StateRevoked
}

// ExceptionRepr is Python's repr of the part's exception, as Celery's
// ChordError message quotes it ("Dependency <id> raised ValueError('boom')"):
// Type('message', ...). A value that is not an exception mapping is
// written as it is.
func (p *ChordPart) ExceptionRepr() string {
	m, ok := p.Value.(map[string]any)
	if !ok {
		return fmt.Sprint(p.Value)
	}
	typ, _ := m["exc_type"].(string)
	if typ == "" {
		typ = "Exception"
	}
	var b strings.Builder
	b.WriteString(typ)
	b.WriteByte('(')
	args, _ := m["exc_message"].([]any)
	if s, ok := m["exc_message"].(string); ok {
		args = []any{s}
	}
	for i, a := range args {
		if i > 0 {
			b.WriteString(", ")
		}
		if s, ok := a.(string); ok {
			b.WriteString(StringRepr(s))
		} else {
			fmt.Fprint(&b, a)
		}
	}
	b.WriteByte(')')
	return b.String()
}
