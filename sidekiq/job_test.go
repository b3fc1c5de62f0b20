package sidekiq

import (
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestDecodePlain(t *testing.T) {
	t.Parallel()
	raw := `{"retry":true,"queue":"default","class":"HardWorker","args":[1,"two",{"x":[3.5]}],"jid":"b4a577edbccf1d805744efa9","created_at":1700000000.123,"enqueued_at":1700000000.5,"idempotency_key":"order-7"}`
	j, err := Decode(raw, "default")
	if err != nil {
		t.Fatal(err)
	}
	if j.Raw != raw || j.Queue != "default" || j.Class != "HardWorker" || j.JID != "b4a577edbccf1d805744efa9" ||
		j.IdempotencyKey != "order-7" || j.RetryCount != -1 || j.Wrapped {
		t.Fatalf("job %+v", j)
	}
	want := []any{json.Number("1"), "two", map[string]any{"x": []any{json.Number("3.5")}}}
	if !reflect.DeepEqual(j.Args, want) {
		t.Fatalf("args %#v", j.Args)
	}
	if j.Fields["created_at"] != json.Number("1700000000.123") {
		t.Fatalf("fields %v", j.Fields)
	}

	j, err = Decode(`{"class":"W","args":[],"retry_count":3}`, "q")
	if err != nil || j.RetryCount != 3 || j.IdempotencyKey != "" || len(j.Args) != 0 {
		t.Fatalf("%+v %v", j, err)
	}
}

func TestDecodeIdempotencyKey(t *testing.T) {
	t.Parallel()
	for raw, want := range map[string]string{
		`{"class":"W","args":[],"idempotency_key":"order-7"}`: "order-7",
		`{"class":"W","args":[],"idempotency_key":4242}`:      "4242",
		`{"class":"W","args":[],"idempotency_key":1e3}`:       "1e3",
		`{"class":"W","args":[],"idempotency_key":null}`:      "",
		`{"class":"W","args":[]}`:                             "",
	} {
		j, err := Decode(raw, "q")
		if err != nil || j.IdempotencyKey != want {
			t.Errorf("%s: key %q, %v; want %q", raw, j.IdempotencyKey, err, want)
		}
	}
}

func TestDecodeErrors(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		raw    string
		reason error
		fields bool
	}{
		{`not json`, ErrBadJSON, false},
		{`[1,2]`, ErrBadJSON, false},
		{`{"class":"W","args":[]} trailing`, ErrBadJSON, false},
		{`{"args":[]}`, ErrMissingClass, true},
		{`{"class":7,"args":[]}`, ErrMissingClass, true},
		{`{"class":"W"}`, ErrBadArgs, true},
		{`{"class":"W","args":{"a":1}}`, ErrBadArgs, true},
		{`{"class":"` + JobWrapperClass + `","wrapped":"J","args":[]}`, ErrBadArgs, true},
		{`{"class":"` + JobWrapperClass + `","wrapped":"J","args":[{"arguments":[{"_aj_serialized":"ActiveJob::Serializers::TimeSerializer","value":"yesterday"}]}]}`, ErrBadArgs, true},
		{`{"class":"` + JobWrapperClass + `","args":[{"arguments":[]}]}`, ErrMissingClass, true},
		{`{"class":"W","args":[],"idempotency_key":true}`, ErrBadKey, true},
		{`{"class":"W","args":[],"idempotency_key":{"id":1}}`, ErrBadKey, true},
	} {
		j, err := Decode(c.raw, "q")
		var de *DecodeError
		if !errors.As(err, &de) || !errors.Is(err, c.reason) || de.Queue != "q" {
			t.Errorf("%s: error %v, want %v", c.raw, err, c.reason)
			continue
		}
		if j == nil || j.Raw != c.raw || j.Queue != "q" || (j.Fields != nil) != c.fields {
			t.Errorf("%s: job %+v", c.raw, j)
		}
	}
}

func TestDecodeActiveJob(t *testing.T) {
	t.Parallel()
	// As ActiveJob 6.1's Sidekiq adapter enqueues it.
	raw := `{"retry":true,"queue":"q1","class":"ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper","wrapped":"ReportJob","args":[{"job_class":"ReportJob","job_id":"40a4a7d9","provider_job_id":null,"queue_name":"q1","priority":null,"arguments":["plain",7,2.5,null,true,[1,"two"],{"_aj_serialized":"ActiveJob::Serializers::SymbolSerializer","value":"sym"},{"s":1,"k":"v","_aj_symbol_keys":["k"]},{"ia":1,"_aj_hash_with_indifferent_access":true},{"_aj_globalid":"gid://app/Person/42"},{"_aj_serialized":"ActiveJob::Serializers::TimeSerializer","value":"2024-03-04T05:06:07.123456000Z"},{"_aj_serialized":"ActiveJob::Serializers::DateSerializer","value":"2024-03-04"},{"_aj_serialized":"ActiveJob::Serializers::DurationSerializer","value":90,"parts":[[{"_aj_serialized":"ActiveJob::Serializers::SymbolSerializer","value":"seconds"},90]]},{"_aj_serialized":"ActiveJob::Serializers::ModuleSerializer","value":"ReportJob"},{"_aj_serialized":"MoneySerializer","cents":{"_aj_serialized":"ActiveJob::Serializers::SymbolSerializer","value":"eur"}},{"kw":"word","_aj_ruby2_keywords":["kw"]}],"executions":0,"exception_executions":{},"locale":"en","timezone":null,"enqueued_at":"2026-12-02T07:27:55Z"}],"jid":"1d2bafbeff5f7ec3ab1d128b","created_at":1796196475.4163213,"enqueued_at":1796196475.418275}`
	j, err := Decode(raw, "q1")
	if err != nil {
		t.Fatal(err)
	}
	if !j.Wrapped || j.Class != "ReportJob" || j.JID != "1d2bafbeff5f7ec3ab1d128b" {
		t.Fatalf("job %+v", j)
	}
	want := activeJobWant()
	want = append(want[:len(want)-1], Serialized{Serializer: "MoneySerializer", Fields: map[string]any{"cents": Symbol("eur")}}, want[len(want)-1])
	if !reflect.DeepEqual(j.Args, want) {
		t.Fatalf("args\n%#v\nwant\n%#v", j.Args, want)
	}
}

// activeJobWant is what the arguments of the Ruby helper's "activejob"
// job become.
func activeJobWant() []any {
	return []any{
		"plain", json.Number("7"), json.Number("2.5"), nil, true, []any{json.Number("1"), "two"},
		Symbol("sym"),
		map[string]any{"s": json.Number("1"), "k": "v"},
		map[string]any{"ia": json.Number("1")},
		GlobalID("gid://app/Person/42"),
		time.Date(2024, 3, 4, 5, 6, 7, 123456000, time.UTC),
		time.Date(2024, 3, 4, 0, 0, 0, 0, time.UTC),
		90 * time.Second,
		Module("ReportJob"),
		Keywords{"kw": "word"},
	}
}

func TestParseQueues(t *testing.T) {
	t.Parallel()
	q, strict, err := parseQueues([]string{"critical", "default", "low"})
	if err != nil || !strict || !reflect.DeepEqual(q, []string{"critical", "default", "low"}) {
		t.Fatalf("%v %v %v", q, strict, err)
	}
	q, strict, err = parseQueues([]string{"critical,3", "low", "zero,0"})
	if err != nil || strict || !reflect.DeepEqual(q, []string{"critical", "critical", "critical", "low", "zero"}) {
		t.Fatalf("%v %v %v", q, strict, err)
	}
	for _, bad := range [][]string{nil, {"a", "a"}, {",2"}, {"a,x"}, {"a,-1"}, {"a,1001"}, {"a,4000000000"}} {
		if _, _, err := parseQueues(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

func TestCompressBacktraceIsRubyBase64(t *testing.T) {
	t.Parallel()
	lines := make([]string, 20)
	for i := range lines {
		lines[i] = "app/workers/hard_worker.rb:12:in `perform'"
	}
	s := compressBacktrace(lines)
	if s[len(s)-1] != '\n' {
		t.Fatalf("no final newline: %q", s)
	}
	for i, l := range splitLines(s) {
		if len(l) > 60 {
			t.Fatalf("line %d has %d characters", i, len(l))
		}
	}
	if m := errorMessage(string(make([]rune, 12000))); len([]rune(m)) != 10000 {
		t.Fatalf("message of %d characters", len([]rune(m)))
	}
	if m := errorMessage("bad \xff byte"); m != "bad \uFFFD byte" {
		t.Fatalf("message %q", m)
	}
}

func splitLines(s string) []string {
	var out []string
	for len(s) > 0 {
		i := 0
		for i < len(s) && s[i] != '\n' {
			i++
		}
		out = append(out, s[:i])
		if i < len(s) {
			i++
		}
		s = s[i:]
	}
	return out
}

func TestConfigChecks(t *testing.T) {
	t.Parallel()
	for _, cfg := range []Config{
		{Queues: []string{"q"}},
		{URL: "redis://127.0.0.1:1/0"},
		{URL: "redis://127.0.0.1:1/0", Queues: []string{"q"}, HeartbeatTTL: 5 * time.Second},
		{URL: "redis://127.0.0.1:1/0", Queues: []string{"q"}, HeartbeatTTL: 500 * time.Millisecond, Heartbeat: 100 * time.Millisecond},
		{URL: "mysql://127.0.0.1/0", Queues: []string{"q"}},
	} {
		if c, err := New(cfg); err == nil {
			_ = c.Close()
			t.Errorf("%+v accepted", cfg)
		}
	}
	if _, err := New(Config{URL: "redis://:s3cret@host:port:x/0", Queues: []string{"q"}}); err == nil || strings.Contains(err.Error(), "s3cret") {
		t.Errorf("bad URL: %v", err)
	}
	if got := RedactURL("redis://:s3cret@cache:6379/2"); got != "redis://:****@cache:6379/2" {
		t.Errorf("redacted %q", got)
	}
}
