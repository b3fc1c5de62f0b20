package celeryproto

import (
	"fmt"
	"math"
	"reflect"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/onceler/onceler/internal/intval"
)

// Field readers: each accepts what the wire may hold for a field (header
// values from an AMQP client, or decoded body values) and says what was
// wrong otherwise.

func badField(k string, v any, want string) error {
	return decodeErr(ErrBadHeader, nil, "%s must be %s, got %s", k, want, typeName(v))
}

// text is str for a field kept as text in PostgreSQL (the task name and
// id, in the record): valid UTF-8 without NUL, which the database refuses.
func text(k string, v any) (string, error) {
	s, err := str(k, v)
	if err == nil && !StorableText(s) {
		err = decodeErr(ErrBadHeader, nil, "%s must be UTF-8 text without NUL", k)
	}
	return s, err
}

// StorableText reports whether PostgreSQL can keep s as text: valid UTF-8
// without NUL.
func StorableText(s string) bool { return utf8.ValidString(s) && !strings.ContainsRune(s, 0) }

func str(k string, v any) (string, error) {
	switch x := v.(type) {
	case nil:
		return "", nil
	case string:
		return x, nil
	case []byte:
		return string(x), nil
	}
	return "", badField(k, v, "a string")
}

func boolValue(k string, v any) (bool, error) {
	switch x := v.(type) {
	case nil:
		return false, nil
	case bool:
		return x, nil
	}
	if n, ok, err := intValue(k, v); err == nil && ok {
		return n != 0, nil
	}
	return false, badField(k, v, "a bool")
}

// maxRetries bounds a message's retries count: a retry count is small
// (each retry is one more message), and a negative or huge one would upset
// the arithmetic of backoffs and of crash counts.
const maxRetries = 1 << 20

// intValue accepts every integer width, integral floats and nil (ok false).
func intValue(k string, v any) (int64, bool, error) {
	if v == nil {
		return 0, false, nil
	}
	if n, ok := intval.Whole(v); ok {
		return n, true, nil
	}
	return 0, false, badField(k, v, "an integer")
}

// seconds reads a time limit element: a number of seconds or nil.
func seconds(v any) (time.Duration, error) {
	var f float64
	switch x := v.(type) {
	case float64:
		f = x
	case float32:
		f = float64(x)
	default:
		n, ok, err := intValue("timelimit element", v)
		if err != nil || !ok {
			return 0, err
		}
		f = float64(n)
	}
	if math.IsNaN(f) || f < 0 || f > float64(math.MaxInt64/int64(time.Second)) {
		return 0, decodeErr(ErrBadHeader, nil, "timelimit element out of range: %v", f)
	}
	return time.Duration(f * float64(time.Second)), nil
}

func timeLimitValue(v any) (TimeLimit, error) {
	var tl TimeLimit
	if v == nil {
		return tl, nil
	}
	list, ok := v.([]any)
	if !ok {
		switch x := v.(type) {
		case []int64:
			list = make([]any, len(x))
			for i, e := range x {
				list[i] = e
			}
		case []float64:
			list = make([]any, len(x))
			for i, e := range x {
				list[i] = e
			}
		default:
			return tl, badField("timelimit", v, "a [hard, soft] list")
		}
	}
	if len(list) != 2 {
		return tl, decodeErr(ErrBadHeader, nil, "timelimit must have 2 elements [hard, soft], got %d", len(list))
	}
	var err error
	if tl.Hard, err = seconds(list[0]); err != nil {
		return tl, err
	}
	if tl.Soft, err = seconds(list[1]); err != nil {
		return tl, err
	}
	return tl, nil
}

// The times Python's datetime holds (years 1 to 9999), in Unix seconds.
const (
	minPythonTime = -62135596800 // 0001-01-01T00:00:00Z
	maxPythonTime = 253402300799 // 9999-12-31T23:59:59Z
)

// timeValue reads an eta or expires: an ISO 8601 string, or a time value
// (an AMQP timestamp in the headers, a YAML or msgpack time in a body).
// header says v is an AMQP header.
//
// A time out of the range Celery can read is refused, never taken for a
// time in the past (an eta in the past runs at once). amqp091-go reads an
// AMQP timestamp, an unsigned count of seconds, as time.Unix(int64(raw)),
// which wraps: near 2^63 the time's arithmetic overflows into the past, and
// from 2^63 on it is before 1970. py-amqp reads it with utcfromtimestamp,
// which fails past the year 9999, so Celery's worker cannot receive such a
// message at all. So an AMQP timestamp must be within 0..9999-12-31, any
// other time within the years 1..9999. Unix() gives back the seconds
// time.Unix was given, wrapped or not.
func timeValue(k string, v any, header bool) (time.Time, error) {
	switch x := v.(type) {
	case nil:
		return time.Time{}, nil
	case time.Time:
		sec := x.Unix()
		switch {
		case header && (sec < 0 || sec > maxPythonTime):
			return time.Time{}, decodeErr(ErrBadHeader, nil, "%s is out of range: AMQP timestamp %d s is past 9999-12-31 (Celery cannot read it)", k, uint64(sec))
		case sec < minPythonTime || sec > maxPythonTime:
			return time.Time{}, decodeErr(ErrBadHeader, nil, "%s is out of range: %d s from 1970 is outside the years 1 to 9999 (Celery cannot read it)", k, sec)
		}
		return x.UTC(), nil
	case string:
		if x == "" {
			return time.Time{}, nil
		}
		t, err := ParseTime(x)
		if err != nil {
			return time.Time{}, decodeErr(ErrBadHeader, err, "bad %s", k)
		}
		return t, nil
	case []byte:
		return timeValue(k, string(x), header)
	}
	return time.Time{}, badField(k, v, "an ISO 8601 time")
}

func stringList(k string, v any) ([]string, error) {
	if v == nil {
		return nil, nil
	}
	list, ok := v.([]any)
	if !ok {
		return nil, badField(k, v, "a list of strings")
	}
	out := make([]string, 0, len(list))
	for _, e := range list {
		s, ok := e.(string)
		if !ok {
			return nil, badField(k+" element", e, "a string")
		}
		out = append(out, s)
	}
	return out, nil
}

func argsValue(k string, v any) ([]any, error) {
	switch x := v.(type) {
	case nil:
		return []any{}, nil
	case []any:
		return x, nil
	}
	return nil, decodeErr(ErrShape, nil, "%s must be a list, got %s", k, typeName(v))
}

func kwargsValue(k string, v any) (map[string]any, error) {
	switch x := v.(type) {
	case nil:
		return map[string]any{}, nil
	case map[string]any:
		return x, nil
	}
	return nil, decodeErr(ErrShape, nil, "%s must be a mapping, got %s", k, typeName(v))
}

func signatures(k string, v any) ([]Signature, error) {
	if v == nil {
		return nil, nil
	}
	list, ok := v.([]any)
	if !ok {
		return nil, decodeErr(ErrShape, nil, "embed %s must be a list of signatures, got %s", k, typeName(v))
	}
	out := make([]Signature, 0, len(list))
	for _, e := range list {
		s, err := signature(k, e)
		if err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	return out, nil
}

func signature(k string, v any) (Signature, error) {
	var s Signature
	m, ok := v.(map[string]any)
	if !ok {
		return s, decodeErr(ErrShape, nil, "%s signature must be a mapping, got %s", k, typeName(v))
	}
	var err error
	if s.Task, err = str(k+".task", m["task"]); err != nil {
		return s, err
	}
	if s.Args, err = argsValue(k+".args", m["args"]); err != nil {
		return s, err
	}
	if s.Kwargs, err = kwargsValue(k+".kwargs", m["kwargs"]); err != nil {
		return s, err
	}
	if s.Options, err = kwargsValue(k+".options", m["options"]); err != nil {
		return s, err
	}
	if s.SubtaskType, err = str(k+".subtask_type", m["subtask_type"]); err != nil {
		return s, err
	}
	if s.Immutable, err = boolValue(k+".immutable", m["immutable"]); err != nil {
		return s, err
	}
	return s, nil
}

// typeName names a decoded value's type the way the wire would: object,
// array, string, number, ...
func typeName(v any) string {
	switch v.(type) {
	case nil:
		return "null"
	case map[string]any:
		return "object"
	case []any:
		return "array"
	case string:
		return "string"
	case bool:
		return "bool"
	case int, int8, int16, int32, int64, uint, uint8, uint16, uint32, uint64:
		return "integer"
	case float32, float64:
		return "number"
	case []byte:
		return "bytes"
	case time.Time:
		return "time"
	}
	return fmt.Sprintf("%T", v)
}

// asMap accepts map[string]any and named map types with the same layout
// (an AMQP client's table type).
func asMap(v any) (map[string]any, bool) {
	if m, ok := v.(map[string]any); ok {
		return m, true
	}
	rv := reflect.ValueOf(v)
	if rv.Kind() != reflect.Map || rv.Type().Key().Kind() != reflect.String || rv.Type().Elem().Kind() != reflect.Interface {
		return nil, false
	}
	out := make(map[string]any, rv.Len())
	for it := rv.MapRange(); it.Next(); {
		out[it.Key().String()] = it.Value().Interface()
	}
	return out, true
}
