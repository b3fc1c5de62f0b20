package amqp091

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// field encodings, as py-amqp writes them.
func longL(v int64) []byte {
	b := []byte{'L', 0, 0, 0, 0, 0, 0, 0, 0}
	binary.BigEndian.PutUint64(b[1:], uint64(v))
	return b
}

func longstr(b []byte) []byte {
	out := binary.BigEndian.AppendUint32(nil, uint32(len(b)))
	return append(out, b...)
}

func shortstr(s string) []byte { return append([]byte{byte(len(s))}, s...) }

// entry is one table entry: key then typed value.
func entry(key string, value []byte) []byte { return append(shortstr(key), value...) }

func table(entries ...[]byte) []byte { return longstr(bytes.Join(entries, nil)) }

// contentHeader builds a whole content header frame on channel 1 carrying
// headers (already a long string), a correlation id and a reply-to, the
// properties that come after the headers on the wire.
func contentHeader(headers []byte) []byte {
	var p []byte
	p = binary.BigEndian.AppendUint16(p, 60) // class basic
	p = binary.BigEndian.AppendUint16(p, 0)  // weight
	p = binary.BigEndian.AppendUint64(p, 3)  // body size
	p = binary.BigEndian.AppendUint16(p, flagContentType|flagHeaders|flagCorrelationId|flagReplyTo)
	p = append(p, shortstr("application/json")...)
	p = append(p, headers...)
	p = append(p, shortstr("task-id-1")...)
	p = append(p, shortstr("reply-queue")...)
	f := []byte{frameHeader, 0, 1}
	f = binary.BigEndian.AppendUint32(f, uint32(len(p)))
	f = append(f, p...)
	return append(f, frameEnd)
}

// readHeader reads frames from the wire: one header frame, then a
// heartbeat that proves the reader is still in step.
func readHeader(t *testing.T, wire []byte) *headerFrame {
	t.Helper()
	wire = append(wire, frameHeartbeat, 0, 0, 0, 0, 0, 0, frameEnd)
	r := reader{r: bytes.NewReader(wire)}
	f, err := r.ReadFrame()
	if err != nil {
		t.Fatalf("ReadFrame: %v (the connection would close)", err)
	}
	hf, ok := f.(*headerFrame)
	if !ok {
		t.Fatalf("frame %T, want *headerFrame", f)
	}
	if hf.Properties.CorrelationId != "task-id-1" || hf.Properties.ReplyTo != "reply-queue" || hf.Properties.ContentType != "application/json" {
		t.Fatalf("properties after the headers misread: %+v", hf.Properties)
	}
	next, err := r.ReadFrame()
	if err != nil {
		t.Fatalf("frame after the header frame: %v", err)
	}
	if _, ok := next.(*heartbeatFrame); !ok {
		t.Fatalf("frame after the header frame is %T, want a heartbeat: out of step", next)
	}
	return hf
}

func TestReadContentHeaders_LongL(t *testing.T) {
	for _, v := range []int64{1 << 31, math.MaxInt64, -(1 << 40), math.MinInt64} {
		hf := readHeader(t, contentHeader(table(entry("big", longL(v)), entry("nested", append([]byte{'F'}, table(entry("x", longL(v)))...)))))
		if hf.Properties.headersErr != nil {
			t.Fatalf("%d: headers unreadable: %v", v, hf.Properties.headersErr)
		}
		if got, ok := hf.Properties.Headers["big"].(int64); !ok || got != v {
			t.Errorf("big = %#v, want int64 %d", hf.Properties.Headers["big"], v)
		}
		if got := hf.Properties.Headers["nested"].(Table)["x"]; got != v {
			t.Errorf("nested.x = %#v, want int64 %d", got, v)
		}
	}
}

func TestReadContentHeaders_Unreadable(t *testing.T) {
	many := make([][]byte, 9000)
	for i := range many {
		many[i] = entry(fmt.Sprintf("k%d", i), []byte{'V'})
	}
	manyV := bytes.Repeat([]byte{'V'}, 9000)
	deep := table(entry("leaf", []byte{'V'}))
	for range 40 {
		deep = table(entry("d", append([]byte{'F'}, deep...)))
	}
	cases := []struct {
		name, reason string
		headers      []byte
	}{
		{"9000 headers", "more than 8192 entries", table(many...)},
		{"9000-element array", "more than 8192 entries", table(entry("a", append([]byte{'A'}, longstr(manyV)...)))},
		{"40-deep table", "nested deeper than 32", deep},
		{"unknown field type", `unknown field type 'Z'`, table(entry("z", []byte{'Z', 1, 2}))},
		{"inner value overruns the table", "unexpected EOF", table(entry("s", []byte{'S', 0, 0, 0, 200, 'x'}))},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			hf := readHeader(t, contentHeader(tc.headers))
			err := hf.Properties.headersErr
			var he *HeadersError
			if !errors.As(err, &he) {
				t.Fatalf("headers error %v, want a *HeadersError", err)
			}
			if he.Size != len(tc.headers)-4 || !strings.Contains(err.Error(), tc.reason) {
				t.Errorf("headers error %q (size %d), want %q and size %d", err, he.Size, tc.reason, len(tc.headers)-4)
			}
			if hf.Properties.Headers != nil {
				t.Errorf("headers %d entries, want nil", len(hf.Properties.Headers))
			}
			d := newDelivery(nil, &basicDeliver{Properties: hf.Properties})
			if d.HeadersError != err || d.CorrelationId != "task-id-1" {
				t.Errorf("delivery: HeadersError %v, CorrelationId %q", d.HeadersError, d.CorrelationId)
			}
		})
	}
}

// A table that claims more bytes than its frame holds is a broken frame,
// not a message to deliver.
func TestReadContentHeaders_BrokenFrame(t *testing.T) {
	headers := binary.BigEndian.AppendUint32(nil, 1000)
	r := reader{r: bytes.NewReader(contentHeader(headers))}
	if _, err := r.ReadFrame(); err == nil {
		t.Fatal("ReadFrame accepted a table longer than its frame")
	}
}

// Method frames keep the library's refusal: a broker that sends a table
// the reader cannot read there is not talking AMQP 0-9-1 as expected.
func TestReadTable_MethodFrameStillRefuses(t *testing.T) {
	deep := table(entry("leaf", []byte{'V'}))
	for range 40 {
		deep = table(entry("d", append([]byte{'F'}, deep...)))
	}
	if _, err := readTable(bytes.NewReader(deep)); !errors.Is(err, errTooDeep) {
		t.Fatalf("readTable: %v, want %v", err, errTooDeep)
	}
}
