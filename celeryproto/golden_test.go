package celeryproto

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/andybalholm/brotli"
	"github.com/klauspost/compress/zstd"
)

// vector is one golden file written by testdata/gen.py.
type vector struct {
	Name       string         `json:"name"`
	Protocol   int            `json:"protocol"`
	Properties map[string]any `json:"properties"`
	Headers    map[string]any `json:"headers"`
	BodyB64    string         `json:"body_b64"`
	Expected   map[string]any `json:"expected"`
}

func loadVectors(tb testing.TB) []vector {
	tb.Helper()
	files, err := filepath.Glob(filepath.Join("testdata", "golden", "*.json"))
	if err != nil || len(files) == 0 {
		tb.Fatalf("no golden vectors: %v", err)
	}
	var out []vector
	for _, f := range files {
		raw, err := os.ReadFile(f)
		if err != nil {
			tb.Fatal(err)
		}
		dec := json.NewDecoder(bytes.NewReader(raw))
		dec.UseNumber()
		var v vector
		if err := dec.Decode(&v); err != nil {
			tb.Fatalf("%s: %v", f, err)
		}
		out = append(out, v)
	}
	return out
}

// amqpValue converts a JSON-decoded header value the way amqp091 hands table
// values over: small integers as int32 (py-amqp writes them as 'I'), larger
// as int64, nested tables as map[string]any, arrays as []any.
func amqpValue(v any) any {
	switch x := v.(type) {
	case json.Number:
		if n, err := x.Int64(); err == nil {
			if n >= math.MinInt32 && n <= math.MaxInt32 {
				return int32(n)
			}
			return n
		}
		f, _ := x.Float64()
		return f
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			out[i] = amqpValue(e)
		}
		return out
	case map[string]any:
		out := make(map[string]any, len(x))
		for k, e := range x {
			out[k] = amqpValue(e)
		}
		return out
	}
	return v
}

// expectedValue converts an expected value to the decoder's value types:
// integers int64, other numbers float64, {"$time"} time.Time, {"$bytes"} []byte.
func expectedValue(tb testing.TB, v any) any {
	switch x := v.(type) {
	case json.Number:
		if n, err := x.Int64(); err == nil {
			return n
		}
		f, _ := x.Float64()
		return f
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			out[i] = expectedValue(tb, e)
		}
		return out
	case map[string]any:
		if s, ok := x["$time"].(string); ok && len(x) == 1 {
			t, err := time.Parse(time.RFC3339Nano, s)
			if err != nil {
				tb.Fatalf("expected time %q: %v", s, err)
			}
			return t.UTC()
		}
		if s, ok := x["$bytes"].(string); ok && len(x) == 1 {
			b, _ := base64.StdEncoding.DecodeString(s)
			return b
		}
		out := make(map[string]any, len(x))
		for k, e := range x {
			out[k] = expectedValue(tb, e)
		}
		return out
	}
	return v
}

func (v vector) delivery(tb testing.TB) *Delivery {
	tb.Helper()
	body, err := base64.StdEncoding.DecodeString(v.BodyB64)
	if err != nil {
		tb.Fatal(err)
	}
	d := &Delivery{Body: body, Headers: map[string]any{}}
	d.ContentType, _ = v.Properties["content_type"].(string)
	d.ContentEncoding, _ = v.Properties["content_encoding"].(string)
	d.CorrelationID, _ = v.Properties["correlation_id"].(string)
	d.ReplyTo, _ = v.Properties["reply_to"].(string)
	if p, ok := v.Properties["priority"].(json.Number); ok {
		n, _ := p.Int64()
		d.Priority = uint8(n)
	}
	for k, h := range v.Headers {
		d.Headers[k] = amqpValue(h)
	}
	return d
}

func optTime(tb testing.TB, v any) time.Time {
	s, _ := v.(string)
	if s == "" {
		return time.Time{}
	}
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		tb.Fatalf("expected time %q: %v", s, err)
	}
	return t.UTC()
}

func optSeconds(v any) time.Duration {
	n, ok := v.(json.Number)
	if !ok {
		return 0
	}
	f, _ := n.Float64()
	return time.Duration(f * float64(time.Second))
}

func expectSignatures(tb testing.TB, v any) []Signature {
	list, _ := v.([]any)
	if list == nil {
		return nil
	}
	out := make([]Signature, 0, len(list))
	for _, e := range list {
		m := e.(map[string]any)
		s := Signature{Task: m["task"].(string), Immutable: m["immutable"].(bool)}
		s.Args = expectedValue(tb, m["args"]).([]any)
		s.Kwargs = expectedValue(tb, m["kwargs"]).(map[string]any)
		s.Options = expectedValue(tb, m["options"]).(map[string]any)
		s.SubtaskType, _ = m["subtask_type"].(string)
		out = append(out, s)
	}
	return out
}

func checkVector(t *testing.T, v vector, got *Message) {
	t.Helper()
	e := v.Expected
	str := func(k string) string { s, _ := e[k].(string); return s }
	if got.Protocol != v.Protocol {
		t.Errorf("protocol = %d, want %d", got.Protocol, v.Protocol)
	}
	for _, c := range []struct{ name, got, want string }{
		{"task", got.Task, str("task")}, {"id", got.ID, str("id")},
		{"root_id", got.RootID, str("root_id")}, {"parent_id", got.ParentID, str("parent_id")},
		{"group", got.GroupID, str("group")}, {"origin", got.Origin, str("origin")},
		{"argsrepr", got.ArgsRepr, str("argsrepr")}, {"kwargsrepr", got.KwargsRepr, str("kwargsrepr")},
		{"compression", got.Compression, str("compression")}, {"reply_to", got.ReplyTo, str("reply_to")},
		{"correlation_id", got.CorrelationID, str("correlation_id")},
	} {
		if c.got != c.want {
			t.Errorf("%s = %q, want %q", c.name, c.got, c.want)
		}
	}
	if want := expectedValue(t, e["args"]); !reflect.DeepEqual(got.Args, want) {
		t.Errorf("args = %#v, want %#v", got.Args, want)
	}
	if want := expectedValue(t, e["kwargs"]); !reflect.DeepEqual(got.Kwargs, want) {
		t.Errorf("kwargs = %#v, want %#v", got.Kwargs, want)
	}
	if want := optTime(t, e["eta"]); !got.ETA.Equal(want) {
		t.Errorf("eta = %v, want %v", got.ETA, want)
	}
	if want := optTime(t, e["expires"]); !got.Expires.Equal(want) {
		t.Errorf("expires = %v, want %v", got.Expires, want)
	}
	if n, _ := e["retries"].(json.Number).Int64(); int64(got.Retries) != n {
		t.Errorf("retries = %d, want %d", got.Retries, n)
	}
	tl := e["timelimit"].([]any)
	if want := (TimeLimit{Hard: optSeconds(tl[0]), Soft: optSeconds(tl[1])}); got.TimeLimit != want {
		t.Errorf("timelimit = %+v, want %+v", got.TimeLimit, want)
	}
	if want, _ := e["ignore_result"].(bool); got.IgnoreResult != want {
		t.Errorf("ignore_result = %v, want %v", got.IgnoreResult, want)
	}
	for _, c := range []struct {
		name string
		got  []Signature
	}{{"callbacks", got.Callbacks}, {"errbacks", got.Errbacks}, {"chain", got.Chain}} {
		if want := expectSignatures(t, e[c.name]); !reflect.DeepEqual(c.got, want) {
			t.Errorf("%s = %#v, want %#v", c.name, c.got, want)
		}
	}
	wantHeaders := expectedValue(t, e["custom_headers"]).(map[string]any)
	for k, want := range wantHeaders {
		if got.Headers[k] != want {
			t.Errorf("header %s = %#v, want %#v", k, got.Headers[k], want)
		}
	}
	for k := range got.Headers {
		if k != "replaced_task_nesting" && wantHeaders[k] == nil {
			t.Errorf("unexpected custom header %q", k)
		}
	}
}

func TestDecodeGolden(t *testing.T) {
	t.Parallel()
	vectors := loadVectors(t)
	seen := map[string]bool{}
	for _, v := range vectors {
		t.Run(v.Name, func(t *testing.T) {
			got, err := Decode(v.delivery(t))
			if err != nil {
				t.Fatalf("decode: %v", err)
			}
			checkVector(t, v, got)
			seen[got.ContentType+"/"+got.Compression] = true
		})
	}
	for _, want := range []string{
		"application/json/", "application/x-msgpack/", "application/x-yaml/",
		"application/json/application/x-gzip", "application/json/application/x-bz2",
		"application/json/application/x-lzma",
	} {
		if !seen[want] {
			t.Errorf("no golden vector covers %s", want)
		}
	}
}

// TestDecodeGoldenSpecifics pins facts of particular vectors so a wrong
// generator cannot make the comparison above vacuous.
func TestDecodeGoldenSpecifics(t *testing.T) {
	t.Parallel()
	byName := map[string]vector{}
	for _, v := range loadVectors(t) {
		byName[v.Name] = v
	}
	decode := func(name string) *Message {
		t.Helper()
		v, ok := byName[name]
		if !ok {
			t.Fatalf("missing vector %s", name)
		}
		m, err := Decode(v.delivery(t))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		return m
	}
	for _, p := range []string{"p1", "p2"} {
		m := decode(p + "_json_timelimit")
		if m.TimeLimit.Hard != 30*time.Second || m.TimeLimit.Soft != 10*time.Second {
			t.Errorf("%s timelimit = %+v, want hard 30s soft 10s", p, m.TimeLimit)
		}
		m = decode(p + "_json_eta_expires")
		if want := time.Date(2031, 5, 1, 12, 0, 0, 123456000, time.UTC); !m.ETA.Equal(want) {
			t.Errorf("%s eta = %v, want %v", p, m.ETA, want)
		}
		if want := time.Date(2031, 5, 2, 8, 30, 0, 500000000, time.UTC); !m.Expires.Equal(want) {
			t.Errorf("%s expires = %v, want %v", p, m.Expires, want)
		}
		for _, ser := range []string{"json", "msgpack", "yaml"} {
			m = decode(p + "_" + ser + "_basic")
			if m.Task != "tasks.add" || !reflect.DeepEqual(m.Args, []any{int64(2), int64(3)}) {
				t.Errorf("%s %s: task %q args %#v", p, ser, m.Task, m.Args)
			}
			if m.Kwargs["big"] != int64(1<<62+1) || m.Kwargs["ratio"] != 1.5 || m.Kwargs["note"] != "h\u00e9llo" {
				t.Errorf("%s %s: kwargs %#v", p, ser, m.Kwargs)
			}
		}
		m = decode(p + "_json_headers")
		if m.Headers["idempotency_key"] != "order-42" || m.Headers["tenant"] != "acme" {
			t.Errorf("%s custom headers = %#v", p, m.Headers)
		}
		m = decode(p + "_json_link")
		if len(m.Callbacks) != 1 || m.Callbacks[0].Task != "tasks.mul" || len(m.Errbacks) != 1 || !m.Errbacks[0].Immutable {
			t.Errorf("%s link: callbacks %+v errbacks %+v", p, m.Callbacks, m.Errbacks)
		}
	}
	m := decode("p2_json_chain")
	if len(m.Chain) != 2 || m.Chain[1].Task != "tasks.add" || m.Chain[0].Task != "tasks.mul" {
		t.Fatalf("chain = %+v, want [mul, add] (next step last)", m.Chain)
	}
	if m.Chain[1].TaskID() == "" || m.Chain[1].ReplyTo() == "" {
		t.Errorf("next chain step not frozen: options %v", m.Chain[1].Options)
	}
	m = decode("p2_json_ignore_result")
	if !m.IgnoreResult || m.Priority != 5 {
		t.Errorf("ignore_result %v priority %d", m.IgnoreResult, m.Priority)
	}
	m = decode("p2_json_kombu53_types")
	if b, ok := m.Args[4].([]byte); !ok || string(b) != "hello" {
		t.Errorf("kombu 5.3 bytes = %#v", m.Args[4])
	}
}

// TestDecodeBrotliZstd: kombu 5.2.4 in Debian cannot write brotli or zstd,
// so these bodies are a Celery-captured body compressed with Go's libraries.
func TestDecodeBrotliZstd(t *testing.T) {
	t.Parallel()
	var base vector
	for _, v := range loadVectors(t) {
		if v.Name == "p2_json_basic" {
			base = v
		}
	}
	plain := base.delivery(t).Body
	var br bytes.Buffer
	bw := brotli.NewWriter(&br)
	_, _ = bw.Write(plain)
	if err := bw.Close(); err != nil {
		t.Fatal(err)
	}
	enc, err := zstd.NewWriter(nil, zstd.WithEncoderConcurrency(1))
	if err != nil {
		t.Fatal(err)
	}
	zs := enc.EncodeAll(plain, nil)
	_ = enc.Close()
	for _, c := range []struct {
		header string
		body   []byte
	}{{"application/x-brotli", br.Bytes()}, {"brotli", br.Bytes()}, {"application/zstd", zs}, {"zstd", zs}} {
		t.Run(strings.ReplaceAll(c.header, "/", "_"), func(t *testing.T) {
			d := base.delivery(t)
			d.Body = c.body
			d.Headers["compression"] = c.header
			got, err := Decode(d)
			if err != nil {
				t.Fatal(err)
			}
			base.Expected["compression"] = c.header
			checkVector(t, base, got)
		})
	}
}
