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
}

// EncodeResult writes r as the rpc:// backend publishes it: JSON body
// {"task_id", "status", "result", "traceback", "children"}, correlation id =
// task id, delivery mode 1. Publish it to the default exchange with the
// task's reply_to as routing key.
func EncodeResult(r *Result) (*Publishing, error) {
	if r == nil || r.TaskID == "" || r.Status == "" {
		return nil, fmt.Errorf("celeryproto: encode result: task id and status are required")
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

func appendException(b []byte, e *Exception) []byte {
	mod := e.Module
	if mod == "" {
		mod = "builtins"
	}
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
