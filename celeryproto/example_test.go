package celeryproto_test

import (
	"errors"
	"fmt"

	"github.com/onceler/onceler/celeryproto"
)

func ExampleDecode() {
	d := &celeryproto.Delivery{
		ContentType:     "application/json",
		ContentEncoding: "utf-8",
		Headers: map[string]any{
			"lang": "py", "task": "shop.charge", "id": "3b1f", "retries": int32(1),
			"eta": "2031-05-01T12:00:00.5+00:00", "timelimit": []any{int32(60), int32(30)},
			"idempotency_key": "order-42",
		},
		Body: []byte(`[[42, 9.5], {"currency": "EUR"}, {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]`),
	}
	m, err := celeryproto.Decode(d)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(m.Protocol, m.Task, m.ID, m.Retries)
	fmt.Printf("%T %v %v\n", m.Args[0], m.Args, m.Kwargs)
	fmt.Println(celeryproto.FormatTime(m.ETA), m.TimeLimit.Hard, m.TimeLimit.Soft)
	fmt.Println(m.Headers["idempotency_key"])
	// Output:
	// 2 shop.charge 3b1f 1
	// int64 [42 9.5] map[currency:EUR]
	// 2031-05-01T12:00:00.500000+00:00 1m0s 30s
	// order-42
}

func ExampleDecode_errors() {
	_, err := celeryproto.Decode(&celeryproto.Delivery{
		ContentType: "application/x-python-serialize",
		Headers:     map[string]any{"task": "t"},
		Body:        []byte{0x80, 0x04},
	})
	fmt.Println(errors.Is(err, celeryproto.ErrPickle), celeryproto.Reason(err))

	_, err = celeryproto.Decode(&celeryproto.Delivery{
		ContentType: "application/json",
		Headers:     map[string]any{"task": "t", "id": "1"},
		Body:        []byte(`{"args": 1}`),
	})
	fmt.Println(errors.Is(err, celeryproto.ErrShape), celeryproto.Reason(err))
	// Output:
	// true unsupported content type "application/x-python-serialize": pickle is never decoded
	// true args must be a list, got integer
}

func ExampleEncodeResult() {
	p, err := celeryproto.EncodeResult(&celeryproto.Result{
		TaskID:    "3b1f",
		Status:    celeryproto.StateFailure,
		Exception: &celeryproto.Exception{Type: "ValueError", Module: "builtins", Message: "boom"},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(p.CorrelationID, p.DeliveryMode, p.ContentType)
	fmt.Println(string(p.Body))
	// Output:
	// 3b1f 1 application/json
	// {"task_id": "3b1f", "status": "FAILURE", "result": {"exc_type": "ValueError", "exc_message": ["boom"], "exc_module": "builtins"}, "traceback": null, "children": []}
}

func ExampleCanonicalArgs() {
	a, _ := celeryproto.CanonicalArgs([]any{int64(1), 2.0}, map[string]any{"b": "x", "a": int32(7)})
	fmt.Println(string(a))
	// Output:
	// [[1, 2.0], {"a": 7, "b": "x"}]
}

// KeyHash identifies an operation in events without revealing its key.
func ExampleKeyHash() {
	fmt.Println(celeryproto.KeyHash("order-42"))
	// Output: 3bf8b157c4238eef
}
