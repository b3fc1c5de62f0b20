package sidekiq

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
	"time"
)

// JobWrapperClass is the "class" of a job that ActiveJob's Sidekiq adapter
// enqueued; the job's own class is in "wrapped" and its arguments in the
// "arguments" of the single argument (the serialized ActiveJob).
const JobWrapperClass = "ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper"

// The reasons Decode gives in a *DecodeError (test them with errors.Is).
var (
	// ErrBadJSON: the element is not one JSON object.
	ErrBadJSON = errors.New("job is not a JSON object")
	// ErrMissingClass: the job has no "class" string.
	ErrMissingClass = errors.New("job has no class")
	// ErrBadArgs: "args" is not a JSON array, or an ActiveJob's arguments
	// cannot be read.
	ErrBadArgs = errors.New("job arguments cannot be read")
	// ErrBadKey: "idempotency_key" is neither a string nor a number.
	ErrBadKey = errors.New("job idempotency_key is not a string or a number")
)

// A DecodeError says why a job fetched from Queue cannot be run; Reason is
// ErrBadJSON, ErrMissingClass, ErrBadArgs or ErrBadKey.
type DecodeError struct {
	Queue  string
	Reason error
	Detail string
}

func (e *DecodeError) Error() string {
	if e.Detail == "" {
		return fmt.Sprintf("sidekiq: job from queue %q: %v", e.Queue, e.Reason)
	}
	return fmt.Sprintf("sidekiq: job from queue %q: %v: %s", e.Queue, e.Reason, e.Detail)
}

// Unwrap returns the reason, for errors.Is.
func (e *DecodeError) Unwrap() error { return e.Reason }

// A Job is one Sidekiq job as fetched from its queue.
type Job struct {
	// Raw is the list element exactly as fetched; the working list holds
	// this string, so it is never re-encoded.
	Raw string
	// Queue is the queue the job was fetched from (without "queue:").
	Queue string
	// Class is the job's "class", or for an ActiveJob (JobWrapperClass)
	// the wrapped job class.
	Class string
	// Args are the positional arguments: "args", or for an ActiveJob its
	// deserialized "arguments" (see the package documentation for the
	// types ActiveJob's serialized values become).
	Args []any
	// JID is the job's "jid".
	JID string
	// IdempotencyKey is the job's "idempotency_key": a string as it is, a
	// number as its JSON text (Ruby's order.id and order.id.to_s name one
	// operation); "" when the job has none, or null or "".
	IdempotencyKey string
	// RetryCount is "retry_count": -1 when the job has never failed
	// (Sidekiq sets 0 at the first failure and adds one per retry).
	RetryCount int
	// Fields is the whole job hash; numbers are json.Number.
	Fields map[string]any
	// Wrapped is true for ActiveJob jobs.
	Wrapped bool

	// epoch is the epoch of the process when Fetch took the job (see
	// recoverScript); fetchID names the memo of that fetch.
	epoch, fetchID string
}

// Decode reads one job, a list element of the queue named queue. On error
// it still returns a *Job holding Raw and Queue (and Fields when the
// element is a JSON object), so the job can be sent to the dead set; the
// error is a *DecodeError.
func Decode(raw string, queue string) (*Job, error) {
	j := &Job{Raw: raw, Queue: queue, RetryCount: -1}
	fields, err := decodeObject(raw)
	if err != nil {
		return j, &DecodeError{Queue: queue, Reason: ErrBadJSON, Detail: err.Error()}
	}
	j.Fields = fields
	if j.Queue == "" {
		j.Queue, _ = fields["queue"].(string)
	}
	j.JID, _ = fields["jid"].(string)
	switch k := fields["idempotency_key"].(type) {
	case nil:
	case string:
		j.IdempotencyKey = k
	case json.Number:
		j.IdempotencyKey = k.String()
	default:
		return j, &DecodeError{Queue: queue, Reason: ErrBadKey, Detail: fmt.Sprintf("idempotency_key is a JSON %s", jsonKind(k))}
	}
	if n, ok := countOf(fields["retry_count"]); ok {
		j.RetryCount = int(n)
	}
	class, _ := fields["class"].(string)
	if class == "" {
		return j, &DecodeError{Queue: queue, Reason: ErrMissingClass}
	}
	j.Class = class
	args, ok := fields["args"].([]any)
	if !ok {
		return j, &DecodeError{Queue: queue, Reason: ErrBadArgs, Detail: `"args" is not an array`}
	}
	j.Args = args
	if class != JobWrapperClass {
		return j, nil
	}
	if len(args) != 1 {
		return j, &DecodeError{Queue: queue, Reason: ErrBadArgs, Detail: fmt.Sprintf("an ActiveJob has one argument, this one %d", len(args))}
	}
	data, ok := args[0].(map[string]any)
	if !ok {
		return j, &DecodeError{Queue: queue, Reason: ErrBadArgs, Detail: "an ActiveJob's argument is not a hash"}
	}
	wrapped, _ := fields["wrapped"].(string)
	if wrapped == "" {
		wrapped, _ = data["job_class"].(string)
	}
	if wrapped == "" {
		return j, &DecodeError{Queue: queue, Reason: ErrMissingClass, Detail: `ActiveJob without "wrapped" or "job_class"`}
	}
	arguments, ok := data["arguments"].([]any)
	if !ok {
		return j, &DecodeError{Queue: queue, Reason: ErrBadArgs, Detail: `an ActiveJob's "arguments" is not an array`}
	}
	out, err := activeJobArgs(arguments)
	if err != nil {
		return j, &DecodeError{Queue: queue, Reason: ErrBadArgs, Detail: err.Error()}
	}
	j.Class, j.Args, j.Wrapped = wrapped, out, true
	return j, nil
}

// decodeObject reads raw as exactly one JSON object, numbers as json.Number.
func decodeObject(raw string) (map[string]any, error) {
	dec := json.NewDecoder(strings.NewReader(raw))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, errors.New("data after the JSON value")
	}
	m, ok := v.(map[string]any)
	if !ok {
		return nil, fmt.Errorf("a JSON %T, not an object", v)
	}
	return m, nil
}

// countOf returns v as an integer when it is a JSON number: a float
// truncated, as Ruby's to_i; clamped to the range of int32.
func countOf(v any) (int64, bool) {
	n, ok := v.(json.Number)
	if !ok {
		return 0, false
	}
	f, err := n.Float64()
	if i, ierr := n.Int64(); ierr == nil {
		f, err = float64(i), nil
	}
	if err != nil && !errors.Is(err, strconv.ErrRange) || math.IsNaN(f) {
		return 0, false
	}
	return int64(max(min(f, math.MaxInt32), math.MinInt32)), true
}

// The types ActiveJob arguments become beyond JSON's own.
type (
	// Symbol is a Ruby Symbol (ActiveJob's SymbolSerializer).
	Symbol string
	// GlobalID is a record reference, "gid://app/Model/id" (_aj_globalid).
	GlobalID string
	// Module is a Ruby class or module name (ActiveJob's ModuleSerializer).
	Module string
	// Keywords are keyword arguments (a hash marked _aj_ruby2_keywords).
	Keywords map[string]any
	// Serialized is an object of a serializer this package does not know
	// (a custom ActiveJob::Serializers::ObjectSerializer): its class name
	// and its other keys, values deserialized.
	Serialized struct {
		Serializer string
		Fields     map[string]any
	}
)

const (
	ajGlobalID   = "_aj_globalid"
	ajSymbolKeys = "_aj_symbol_keys"
	ajRuby2Kw    = "_aj_ruby2_keywords"
	ajIndiff     = "_aj_hash_with_indifferent_access"
	ajSerialized = "_aj_serialized"
)

func activeJobArgs(args []any) ([]any, error) {
	out := make([]any, len(args))
	for i, a := range args {
		v, err := activeJobValue(a)
		if err != nil {
			return nil, fmt.Errorf("argument %d: %w", i, err)
		}
		out[i] = v
	}
	return out, nil
}

func activeJobValue(v any) (any, error) {
	switch v := v.(type) {
	case []any:
		return activeJobArgs(v)
	case map[string]any:
		return activeJobHash(v)
	default:
		return v, nil
	}
}

func activeJobHash(h map[string]any) (any, error) {
	if gid, ok := h[ajGlobalID]; ok && len(h) == 1 {
		s, ok := gid.(string)
		if !ok {
			return nil, fmt.Errorf("%s is not a string", ajGlobalID)
		}
		return GlobalID(s), nil
	}
	if name, ok := h[ajSerialized]; ok {
		s, ok := name.(string)
		if !ok {
			return nil, fmt.Errorf("%s is not a string", ajSerialized)
		}
		return activeJobObject(s, h)
	}
	out := make(map[string]any, len(h))
	for k, v := range h {
		switch k {
		case ajSymbolKeys, ajRuby2Kw, ajIndiff:
			continue
		}
		d, err := activeJobValue(v)
		if err != nil {
			return nil, fmt.Errorf("key %q: %w", k, err)
		}
		out[k] = d
	}
	if _, ok := h[ajIndiff]; ok {
		return out, nil
	}
	if _, ok := h[ajSymbolKeys]; ok {
		return out, nil
	}
	if _, ok := h[ajRuby2Kw]; ok {
		return Keywords(out), nil
	}
	return out, nil
}

func activeJobObject(serializer string, h map[string]any) (any, error) {
	str := func() (string, error) {
		s, ok := h["value"].(string)
		if !ok {
			return "", fmt.Errorf("%s: value is not a string", serializer)
		}
		return s, nil
	}
	switch serializer {
	case "ActiveJob::Serializers::SymbolSerializer":
		s, err := str()
		return Symbol(s), err
	case "ActiveJob::Serializers::ModuleSerializer":
		s, err := str()
		return Module(s), err
	case "ActiveJob::Serializers::TimeSerializer",
		"ActiveJob::Serializers::TimeWithZoneSerializer",
		"ActiveJob::Serializers::DateTimeSerializer":
		s, err := str()
		if err != nil {
			return nil, err
		}
		t, err := time.Parse(time.RFC3339Nano, s)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", serializer, err)
		}
		return t, nil
	case "ActiveJob::Serializers::DateSerializer":
		s, err := str()
		if err != nil {
			return nil, err
		}
		t, err := time.Parse(time.DateOnly, s)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", serializer, err)
		}
		return t, nil
	case "ActiveJob::Serializers::DurationSerializer":
		n, ok := h["value"].(json.Number)
		if !ok {
			return nil, fmt.Errorf("%s: value is not a number", serializer)
		}
		f, err := n.Float64()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", serializer, err)
		}
		ns := f * float64(time.Second)
		if math.IsNaN(ns) || ns >= math.MaxInt64 || ns < math.MinInt64 {
			return nil, fmt.Errorf("%s: %v s is beyond a time.Duration (about 292 years)", serializer, f)
		}
		return time.Duration(ns), nil
	}
	fields := make(map[string]any, len(h))
	for k, v := range h {
		if k == ajSerialized {
			continue
		}
		d, err := activeJobValue(v)
		if err != nil {
			return nil, fmt.Errorf("%s: key %q: %w", serializer, k, err)
		}
		fields[k] = d
	}
	return Serialized{Serializer: serializer, Fields: fields}, nil
}

// jsonKind names the JSON type of a decoded value.
func jsonKind(v any) string {
	switch v.(type) {
	case bool:
		return "boolean"
	case []any:
		return "array"
	case map[string]any:
		return "object"
	default:
		return fmt.Sprintf("%T", v)
	}
}
