package celeryproto

import (
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"
)

func richMessage() *Message {
	gi := 2
	return &Message{
		Task: "tasks.charge", ID: "id-9", Args: []any{int64(-5), "x", 2.5, []any{true, nil}, map[string]any{"k": int64(1 << 40)}},
		Kwargs:    map[string]any{"amount": 12.75, "note": "caf\u00e9 \U0001F600 \"q\"\n", "when": time.Date(2031, 1, 2, 3, 4, 5, 600000000, time.UTC)},
		Callbacks: []Signature{{Task: "tasks.cb", Args: []any{int64(1)}, Kwargs: map[string]any{}, Options: map[string]any{"queue": "q"}}},
		Errbacks:  []Signature{{Task: "tasks.eb", Args: []any{}, Kwargs: map[string]any{}, Options: map[string]any{}, Immutable: true}},
		Chain:     []Signature{{Task: "tasks.last", Args: []any{}, Kwargs: map[string]any{}, Options: map[string]any{"task_id": "t3", "reply_to": "r"}}},
		Chord:     &Signature{Task: "tasks.body", Args: []any{}, Kwargs: map[string]any{}, Options: map[string]any{}, SubtaskType: "chord"},
		ETA:       time.Date(2031, 5, 1, 12, 0, 0, 123456000, time.UTC), Expires: time.Date(2031, 5, 2, 0, 0, 0, 0, time.UTC),
		Retries: 3, TimeLimit: TimeLimit{Hard: 90 * time.Second, Soft: 1500 * time.Millisecond},
		RootID: "root", ParentID: "parent", GroupID: "g", GroupIndex: &gi, Shadow: "charge!", IgnoreResult: true,
		ReplyTo: "reply", Origin: "gen1@h", ArgsRepr: "(-5, 'x')", KwargsRepr: "{...}",
		Headers: map[string]any{"idempotency_key": "k-1"}, Priority: 3,
	}
}

// TestEncodeDecodeRoundTrip: every protocol, serializer and compression this
// package writes decodes back to the same message.
func TestEncodeDecodeRoundTrip(t *testing.T) {
	t.Parallel()
	now := func() time.Time { return time.Date(2031, 5, 1, 23, 0, 0, 0, time.UTC) }
	for _, proto := range []int{1, 2} {
		for _, ser := range []string{"json", "msgpack", "yaml"} {
			for _, comp := range []string{"", "zlib", "xz", "brotli", "zstd"} {
				name := strings.Join([]string{string(rune('0' + proto)), ser, comp}, "/")
				t.Run(name, func(t *testing.T) {
					in := richMessage()
					p, err := EncodeTask(in, EncodeOptions{Protocol: proto, Serializer: ser, Compression: comp, Now: now})
					if err != nil {
						t.Fatal(err)
					}
					if p.Expiration != "3600000" || p.CorrelationID != "id-9" || p.DeliveryMode != 2 || p.Priority != 3 {
						t.Errorf("properties: expiration %q correlation %q mode %d priority %d", p.Expiration, p.CorrelationID, p.DeliveryMode, p.Priority)
					}
					got, err := Decode(&Delivery{ContentType: p.ContentType, ContentEncoding: p.ContentEncoding, Headers: p.Headers,
						Body: p.Body, CorrelationID: p.CorrelationID, ReplyTo: p.ReplyTo, Priority: p.Priority})
					if err != nil {
						t.Fatal(err)
					}
					want := richMessage()
					want.Protocol = proto
					want.ContentType, want.ContentEncoding, want.CorrelationID = p.ContentType, p.ContentEncoding, "id-9"
					want.Compression, _ = p.Headers["compression"].(string)
					// Times in arguments travel as the strings kombu 5.2 sends.
					want.Kwargs["when"] = "2031-01-02T03:04:05.600000+00:00"
					if proto == 1 { // protocol 1 has no place for these
						want.Chain, want.RootID, want.ParentID, want.Shadow, want.IgnoreResult = nil, "", "", "", false
						want.ArgsRepr, want.KwargsRepr, want.Origin = "", "", ""
					}
					if !reflect.DeepEqual(got, want) {
						t.Errorf("round trip differs:\n got %+v\nwant %+v", got, want)
					}
				})
			}
		}
	}
}

func TestEncodeErrors(t *testing.T) {
	t.Parallel()
	if _, err := EncodeTask(&Message{Task: "t"}, EncodeOptions{}); err == nil {
		t.Error("encoded a task without id")
	}
	if _, err := EncodeTask(&Message{Task: "t", ID: "1"}, EncodeOptions{Serializer: "pickle"}); err == nil {
		t.Error("encoded with pickle")
	}
	if _, err := EncodeTask(&Message{Task: "t", ID: "1"}, EncodeOptions{Compression: "bzip2"}); err == nil {
		t.Error("bzip2 encoding claimed")
	}
	if _, err := EncodeTask(&Message{Task: "t", ID: "1", Args: []any{make(chan int)}}, EncodeOptions{}); err == nil {
		t.Error("encoded a channel")
	}
	if _, err := EncodeResult(&Result{Status: StateSuccess}); err == nil {
		t.Error("encoded a result without task id")
	}
	var de *DecodeError
	if errors.As(errors.New("x"), &de) || IsDecodeError(errors.New("x")) || Reason(nil) != "" {
		t.Error("predicates on a plain error")
	}
}

func TestEncodeResultStates(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		r    Result
		want string
	}{
		{Result{TaskID: "a", Status: StateSuccess, Value: []int{1, 2}}, `{"task_id": "a", "status": "SUCCESS", "result": [1, 2], "traceback": null, "children": []}`},
		{Result{TaskID: "b", Status: StateRetry, Exception: &Exception{Type: "Retry", Module: "celery.exceptions", Message: "Retry in 5s"}},
			`{"task_id": "b", "status": "RETRY", "result": {"exc_type": "Retry", "exc_message": ["Retry in 5s"], "exc_module": "celery.exceptions"}, "traceback": null, "children": []}`},
		{Result{TaskID: "c", Status: StateRevoked, Exception: &Exception{Type: "TaskRevokedError", Module: "celery.exceptions"}},
			`{"task_id": "c", "status": "REVOKED", "result": {"exc_type": "TaskRevokedError", "exc_message": [], "exc_module": "celery.exceptions"}, "traceback": null, "children": []}`},
		{Result{TaskID: "d", Status: StateSuccess, Value: nil}, `{"task_id": "d", "status": "SUCCESS", "result": null, "traceback": null, "children": []}`},
	} {
		p, err := EncodeResult(&c.r)
		if err != nil {
			t.Fatal(err)
		}
		if string(p.Body) != c.want {
			t.Errorf("body %s\nwant %s", p.Body, c.want)
		}
	}
}
