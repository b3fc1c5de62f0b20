package celeryproto

import "fmt"

// State is a Celery task state.
type State string

// Task states as Celery names them.
const (
	StatePending State = "PENDING"
	StateStarted State = "STARTED"
	StateSuccess State = "SUCCESS"
	StateFailure State = "FAILURE"
	StateRetry   State = "RETRY"
	StateRevoked State = "REVOKED"
)

// Exception is a Python exception as Celery's result backends carry it:
// {"exc_type": Type, "exc_message": [Message], "exc_module": Module}.
type Exception struct{ Type, Module, Message string }

// Result is a task result for the rpc:// backend.
type Result struct {
	TaskID string
	Status State
	// Value is the result of a SUCCESS: any JSON-able value.
	Value any
	// Exception is the error of a FAILURE, RETRY or REVOKED.
	Exception *Exception
	Traceback string
	Children  []any
	// Serializer is "json" (the default), "msgpack" or "yaml": Celery's
	// result_serializer, which the callers' result_accept_content must
	// accept.
	Serializer string
}

// EncodeResult writes r as the rpc:// backend publishes it: body
// {"task_id", "status", "result", "traceback", "children"} in r.Serializer,
// correlation id = task id, delivery mode 1. Publish it to the default
// exchange with the task's reply_to as routing key.
func EncodeResult(r *Result) (*Publishing, error) {
	if r == nil || r.TaskID == "" || r.Status == "" {
		return nil, fmt.Errorf("celeryproto: encode result: task id and status are required")
	}
	if r.Serializer != "" && r.Serializer != "json" {
		return encodeResultAs(r)
	}
	b := make([]byte, 0, 256)
	b = append(b, `{"task_id": `...)
	b = appendJSONString(b, r.TaskID)
	b = append(b, `, "status": `...)
	b = appendJSONString(b, string(r.Status))
	b = append(b, `, "result": `...)
	var err error
	switch {
	case r.Exception != nil:
		b = appendException(b, r.Exception)
	default:
		if b, err = appendJSONValue(b, r.Value, 0); err != nil {
			return nil, fmt.Errorf("celeryproto: encode result of %s: %w", r.TaskID, err)
		}
	}
	b = append(b, `, "traceback": `...)
	if r.Traceback == "" {
		b = append(b, "null"...)
	} else {
		b = appendJSONString(b, r.Traceback)
	}
	b = append(b, `, "children": `...)
	children := r.Children
	if children == nil {
		children = []any{}
	}
	if b, err = appendJSONValue(b, children, 0); err != nil {
		return nil, fmt.Errorf("celeryproto: encode result children of %s: %w", r.TaskID, err)
	}
	b = append(b, '}')
	return &Publishing{
		ContentType: ContentTypeJSON, ContentEncoding: "utf-8",
		Body: b, CorrelationID: r.TaskID, DeliveryMode: 1,
	}, nil
}

// module is the exception's module; "builtins" when unset.
func (e *Exception) module() string {
	if e.Module == "" {
		return "builtins"
	}
	return e.Module
}

func appendException(b []byte, e *Exception) []byte {
	mod := e.module()
	b = append(b, `{"exc_type": `...)
	b = appendJSONString(b, e.Type)
	b = append(b, `, "exc_message": [`...)
	if e.Message != "" {
		b = appendJSONString(b, e.Message)
	}
	b = append(b, `], "exc_module": `...)
	b = appendJSONString(b, mod)
	return append(b, '}')
}

// resultValue is the result field of r as Celery writes it: the value, or
// for a failure the exception as exc_type, exc_message and exc_module.
func (r *Result) resultValue() any {
	e := r.Exception
	if e == nil {
		return r.Value
	}
	msg := []any{}
	if e.Message != "" {
		msg = []any{e.Message}
	}
	return map[string]any{"exc_type": e.Type, "exc_message": msg, "exc_module": e.module()}
}

// encodeResultAs writes r's body with r.Serializer (msgpack or yaml).
func encodeResultAs(r *Result) (*Publishing, error) {
	result := r.resultValue()
	var tb any
	if r.Traceback != "" {
		tb = r.Traceback
	}
	children := r.Children
	if children == nil {
		children = []any{}
	}
	body := map[string]any{"task_id": r.TaskID, "status": string(r.Status), "result": result,
		"traceback": tb, "children": children}
	ct, enc, b, err := marshal(r.Serializer, body)
	if err != nil {
		return nil, fmt.Errorf("celeryproto: encode result of %s: %w", r.TaskID, err)
	}
	return &Publishing{ContentType: ct, ContentEncoding: enc, Body: b, CorrelationID: r.TaskID, DeliveryMode: 1}, nil
}
