package celeryproto

import (
	"errors"
	"strings"
	"testing"
)

// A delivery whose headers the transport could not read is refused, even
// when its body alone would decode (a protocol 1 body carries its task).
func TestDecode_UnreadableHeaders(t *testing.T) {
	t.Parallel()
	d := &Delivery{
		ContentType: "application/json", ContentEncoding: "utf-8",
		Body: []byte(`{"task": "t.add", "id": "id-1", "args": [1, 2], "kwargs": {}}`),
	}
	if _, err := Decode(d); err != nil {
		t.Fatalf("the body alone does not decode: %v", err)
	}
	d.HeadersError = errors.New("header table of 120000 bytes unreadable: a table or array with more than 8192 entries")
	msg, err := Decode(d)
	if msg != nil || !errors.Is(err, ErrBadHeader) || !errors.Is(err, d.HeadersError) {
		t.Fatalf("Decode = %v, %v; want ErrBadHeader wrapping the transport's reason", msg, err)
	}
	if r := Reason(err); !strings.Contains(r, "headers unreadable") || !strings.Contains(r, "more than 8192 entries") {
		t.Errorf("Reason = %q", r)
	}
}
