package celeryproto

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"os/exec"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/onceler/onceler/internal/testenv"
)

// kombuCapture makes kombu's Mailbox publish a cast and a call to a node
// queue of a private namespace, then fetches them back raw.
const kombuCapture = `
import base64, json, sys
from kombu import Connection
from kombu.pidbox import Mailbox
ns = sys.argv[2]
with Connection(sys.argv[1]) as conn:
    mb = Mailbox(ns, type='fanout', accept=['json'], queue_ttl=300.0, queue_expires=10.0)(conn)
    q = mb.get_queue('cap@host')(conn.default_channel)
    q.declare()
    mb._broadcast('revoke', {'task_id': ['a', 'b'], 'terminate': True, 'signal': 'SIGTERM', 'n': 3, 'f': 1.5},
                  destination=['cap@host'], reply=False)
    mb._broadcast('ping', {}, reply=True, timeout=0.05, pattern='cap@*', matcher='glob')
    out = []
    for _ in range(2):
        m = q.get(no_ack=True, accept=['json'])
        body = m.body if isinstance(m.body, bytes) else m.body.encode()
        out.append({'content_type': m.content_type, 'content_encoding': m.content_encoding,
                    'headers': m.headers, 'body': base64.b64encode(body).decode()})
    q.delete()
    print(json.dumps(out))
`

func TestDecodeControlFromKombu(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL(t)
	py := testenv.Python(t)
	out, err := exec.Command(py, "-c", kombuCapture, url, testenv.Name("capns")).Output()
	if err != nil {
		t.Fatalf("kombu capture: %v", err)
	}
	var msgs []struct {
		ContentType     string         `json:"content_type"`
		ContentEncoding string         `json:"content_encoding"`
		Headers         map[string]any `json:"headers"`
		Body            string         `json:"body"`
	}
	if err := json.Unmarshal(out, &msgs); err != nil {
		t.Fatalf("capture output %q: %v", out, err)
	}
	seen := map[string]*ControlRequest{}
	for _, m := range msgs {
		body, err := base64.StdEncoding.DecodeString(m.Body)
		if err != nil {
			t.Fatal(err)
		}
		// AMQP tables hand over integers as int64/int32 and floats as float64
		h := map[string]any{}
		for k, v := range m.Headers {
			if f, ok := v.(float64); ok && f == float64(int64(f)) {
				h[k] = int32(f)
			} else {
				h[k] = v
			}
		}
		req, err := DecodeControl(&Delivery{ContentType: m.ContentType, ContentEncoding: m.ContentEncoding, Headers: h, Body: body})
		if err != nil {
			t.Fatalf("decode %s: %v", body, err)
		}
		seen[req.Method] = req
	}
	rv, ping := seen["revoke"], seen["ping"]
	if rv == nil || ping == nil {
		t.Fatalf("want revoke and ping, got %v", seen)
	}
	wantArgs := map[string]any{"task_id": []any{"a", "b"}, "terminate": true, "signal": "SIGTERM", "n": int64(3), "f": 1.5}
	if !reflect.DeepEqual(rv.Arguments, wantArgs) {
		t.Errorf("revoke arguments = %#v, want %#v", rv.Arguments, wantArgs)
	}
	if !reflect.DeepEqual(rv.Destination, []string{"cap@host"}) || rv.WantsReply() || rv.Ticket != "" {
		t.Errorf("revoke = %+v: want destination cap@host, no reply", rv)
	}
	if rv.Clock < 1 || rv.Expires.Before(time.Now().Add(-time.Minute)) {
		t.Errorf("revoke clock %d expires %v", rv.Clock, rv.Expires)
	}
	if ping.Pattern != "cap@*" || ping.Matcher != "glob" || len(ping.Destination) != 0 {
		t.Errorf("ping selection = %+v", ping)
	}
	if !ping.WantsReply() || ping.Ticket == "" || ping.ReplyRoutingKey == "" {
		t.Errorf("ping reply = %+v", ping)
	}
	if !strings.HasPrefix(ping.ReplyExchange, "reply.capns_") || !strings.HasSuffix(ping.ReplyExchange, ".pidbox") {
		t.Errorf("reply exchange %q", ping.ReplyExchange)
	}
}

func TestDecodeControlRefuses(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		d    Delivery
		want error
	}{
		{"pickle", Delivery{ContentType: "application/x-python-serialize", Body: []byte("\x80\x04.")}, ErrPickle},
		{"yaml", Delivery{ContentType: "application/x-yaml", Body: []byte("method: ping")}, ErrUnsupportedContentType},
		{"compressed", Delivery{ContentType: "application/json", Headers: map[string]any{"compression": "application/x-gzip"}, Body: []byte("x")}, ErrCompression},
		{"not json", Delivery{ContentType: "application/json", Body: []byte("{")}, ErrMalformed},
		{"list", Delivery{ContentType: "application/json", Body: []byte("[]")}, ErrMalformed},
		{"no method", Delivery{ContentType: "application/json", Body: []byte(`{"arguments":{}}`)}, ErrShape},
		{"bad arguments", Delivery{ContentType: "application/json", Body: []byte(`{"method":"ping","arguments":[1]}`)}, ErrShape},
		{"bad destination", Delivery{ContentType: "application/json", Body: []byte(`{"method":"ping","destination":[1]}`)}, ErrShape},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := DecodeControl(&tc.d)
			if !errors.Is(err, tc.want) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
			var de *DecodeError
			if !errors.As(err, &de) || de.Reason == nil {
				t.Fatalf("err %v is not a *DecodeError with a reason", err)
			}
		})
	}
}

// kombuReply reads a reply as kombu's Mailbox._collect does.
const kombuReply = `
import json, sys
from kombu.serialization import loads
body = sys.stdin.buffer.read()
print(json.dumps(loads(body, sys.argv[1], sys.argv[2], accept={'application/json'})))
`

func TestEncodeControlReplyKombu(t *testing.T) {
	t.Parallel()
	py := testenv.Python(t)
	result := map[string]any{"ok": "pong", "n": int64(7), "list": []any{"a", 1.5, nil, true}}
	p, err := EncodeControlReply("onceler-1@host", result, "tick-1", 42)
	if err != nil {
		t.Fatal(err)
	}
	if p.Headers["ticket"] != "tick-1" || p.Headers["clock"] != int64(42) || p.DeliveryMode != 1 {
		t.Fatalf("reply publishing = %+v", p)
	}
	cmd := exec.Command(py, "-c", kombuReply, p.ContentType, p.ContentEncoding)
	cmd.Stdin = bytes.NewReader(p.Body)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("kombu loads: %v", err)
	}
	var got map[string]any
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatal(err)
	}
	want := map[string]any{"onceler-1@host": map[string]any{"ok": "pong", "n": 7.0, "list": []any{"a", 1.5, nil, true}}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("kombu read %v, want %v", got, want)
	}
	if _, err := EncodeControlReply("", nil, "", 0); err == nil {
		t.Fatal("empty node name accepted")
	}
}
