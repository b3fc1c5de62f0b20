package celeryproto

import (
	"encoding/json"
	"testing"
)

// TestEncodeResultRawJSON: a json.RawMessage result is written as the JSON
// it holds, not as a list of byte values; invalid JSON is an error.
func TestEncodeResultRawJSON(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		v    json.RawMessage
		want string
	}{
		{json.RawMessage(`{"b": [1, 2.5, "x"], "a": null}`), `{"b":[1,2.5,"x"],"a":null}`},
		{json.RawMessage(`113`), `113`},
		{nil, `null`},
	} {
		p, err := EncodeResult(&Result{TaskID: "r", Status: StateSuccess, Value: c.v})
		if err != nil {
			t.Fatal(err)
		}
		want := `{"task_id": "r", "status": "SUCCESS", "result": ` + c.want + `, "traceback": null, "children": []}`
		if string(p.Body) != want {
			t.Errorf("body %s\nwant %s", p.Body, want)
		}
	}
	if _, err := EncodeResult(&Result{TaskID: "r", Status: StateSuccess, Value: json.RawMessage(`{"a":`)}); err == nil {
		t.Error("invalid raw JSON encoded without error")
	}
}
