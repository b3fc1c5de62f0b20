package celeryproto

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"os/exec"
	"reflect"
	"testing"
	"time"

	"github.com/onceler/onceler/internal/testenv"
)

type pyPublishing struct {
	ContentType     string         `json:"content_type"`
	ContentEncoding string         `json:"content_encoding"`
	Headers         map[string]any `json:"headers"`
	Body            string         `json:"body"`
	CorrelationID   string         `json:"correlation_id"`
	ReplyTo         string         `json:"reply_to"`
	DeliveryMode    uint8          `json:"delivery_mode"`
	Priority        uint8          `json:"priority"`
}

func toPy(p *Publishing) pyPublishing {
	return pyPublishing{
		ContentType: p.ContentType, ContentEncoding: p.ContentEncoding, Headers: p.Headers,
		Body: base64.StdEncoding.EncodeToString(p.Body), CorrelationID: p.CorrelationID,
		ReplyTo: p.ReplyTo, DeliveryMode: p.DeliveryMode, Priority: p.Priority,
	}
}

type pyTask struct {
	Protocol       int            `json:"protocol"`
	Name           string         `json:"name"`
	ID             string         `json:"id"`
	Args           []any          `json:"args"`
	Kwargs         map[string]any `json:"kwargs"`
	ETA            *string        `json:"eta"`
	Expires        *string        `json:"expires"`
	TimeLimits     []any          `json:"time_limits"`
	Retries        float64        `json:"retries"`
	RootID         string         `json:"root_id"`
	ParentID       string         `json:"parent_id"`
	ReplyTo        string         `json:"reply_to"`
	CorrelationID  string         `json:"correlation_id"`
	Callbacks      []string       `json:"callbacks"`
	Chain          []string       `json:"chain"`
	IdempotencyKey string         `json:"idempotency_key"`
}

type pyResult struct {
	TaskID        string `json:"task_id"`
	CorrelationID string `json:"correlation_id"`
	State         string `json:"state"`
	Value         any    `json:"value"`
	Raised        *struct {
		Module, Type, Str string
		Args              []string
		IsException       bool `json:"is_exception"`
	} `json:"raised"`
}

// TestRoundTripPython: messages and results encoded here are decoded by real
// Celery 5.2.6 / kombu 5.2.4 (worker Request parsing, rpc backend result
// machinery) in a /usr/bin/python3 subprocess.
func TestRoundTripPython(t *testing.T) {
	t.Parallel()
	py := testenv.Python(t)
	eta := time.Date(2031, 5, 1, 12, 0, 0, 123456000, time.UTC)
	expires := time.Date(2031, 5, 2, 0, 0, 0, 0, time.UTC)
	base := Message{
		Task: "tasks.add", ID: "5e1a1f0e-0000-4000-8000-000000000001",
		Args: []any{int64(2), int64(3)}, Kwargs: map[string]any{"note": "h\u00e9", "big": int64(1<<62 + 1), "r": 0.25},
		ETA: eta, Expires: expires, Retries: 2,
		TimeLimit: TimeLimit{Hard: 30 * time.Second, Soft: 10 * time.Second},
		RootID:    "root-1", ParentID: "parent-1", ReplyTo: "reply-q",
		Callbacks: []Signature{{Task: "tasks.mul", Args: []any{int64(10)}}},
		Chain:     []Signature{{Task: "tasks.last"}, {Task: "tasks.next", Options: map[string]any{"task_id": "n1"}}},
		Headers:   map[string]any{"idempotency_key": "order-42"},
	}
	variants := []EncodeOptions{
		{}, {Serializer: "msgpack"}, {Serializer: "yaml"}, {Compression: "zlib"},
		{Compression: "xz", Serializer: "msgpack"}, {Protocol: 1}, {Protocol: 1, Serializer: "yaml", Compression: "gzip"},
	}
	var in struct {
		Tasks   []pyPublishing `json:"tasks"`
		Results []pyPublishing `json:"results"`
	}
	for _, o := range variants {
		p, err := EncodeTask(&base, o)
		if err != nil {
			t.Fatalf("%+v: %v", o, err)
		}
		in.Tasks = append(in.Tasks, toPy(p))
	}
	results := []*Result{
		{TaskID: "r-success", Status: StateSuccess, Value: map[string]any{"total": int64(5), "items": []any{"a", 1.5}}},
		{TaskID: "r-value", Status: StateFailure, Exception: &Exception{Type: "ValueError", Module: "builtins", Message: "boom"}, Traceback: "Traceback...\nValueError: boom"},
		{TaskID: "r-notreg", Status: StateFailure, Exception: &Exception{Type: "NotRegistered", Module: "celery.exceptions", Message: "tasks.nope"}},
		{TaskID: "r-revoked", Status: StateRevoked, Exception: &Exception{Type: "TaskRevokedError", Module: "celery.exceptions", Message: "expired"}},
		{TaskID: "r-timelimit", Status: StateFailure, Exception: &Exception{Type: "TimeLimitExceeded", Module: "billiard.exceptions", Message: "30"}},
		{TaskID: "r-custom", Status: StateFailure, Exception: &Exception{Type: "PaymentDeclined", Module: "shop.errors", Message: "card"}},
	}
	for _, r := range results {
		p, err := EncodeResult(r)
		if err != nil {
			t.Fatal(err)
		}
		in.Results = append(in.Results, toPy(p))
	}
	stdin, _ := json.Marshal(in)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, py, "testdata/roundtrip.py")
	cmd.Stdin = bytes.NewReader(stdin)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	outRaw, err := cmd.Output()
	if err != nil {
		t.Fatalf("python: %v\n%s", err, stderr.String())
	}
	var out struct {
		Tasks   []pyTask   `json:"tasks"`
		Results []pyResult `json:"results"`
	}
	if err := json.Unmarshal(outRaw, &out); err != nil {
		t.Fatalf("python output %s: %v", outRaw, err)
	}
	if len(out.Tasks) != len(variants) || len(out.Results) != len(results) {
		t.Fatalf("python answered %d tasks, %d results", len(out.Tasks), len(out.Results))
	}
	for i, got := range out.Tasks {
		o := variants[i]
		wantProto := 2
		if o.Protocol == 1 {
			wantProto = 1
		}
		if got.Protocol != wantProto || got.Name != "tasks.add" || got.ID != base.ID {
			t.Errorf("%+v: protocol %d name %q id %q", o, got.Protocol, got.Name, got.ID)
		}
		if !reflect.DeepEqual(got.Args, []any{2.0, 3.0}) {
			t.Errorf("%+v: args %v", o, got.Args)
		}
		if got.Kwargs["note"] != "h\u00e9" || got.Kwargs["r"] != 0.25 || got.Kwargs["big"] != float64(1<<62+1) {
			t.Errorf("%+v: kwargs %v", o, got.Kwargs)
		}
		if got.ETA == nil || *got.ETA != "2031-05-01T12:00:00.123456+00:00" {
			t.Errorf("%+v: Celery parsed eta %v, want 2031-05-01T12:00:00.123456+00:00", o, got.ETA)
		}
		if got.Expires == nil || *got.Expires != "2031-05-02T00:00:00+00:00" {
			t.Errorf("%+v: Celery parsed expires %v", o, got.Expires)
		}
		if !reflect.DeepEqual(got.TimeLimits, []any{30.0, 10.0}) || got.Retries != 2 {
			t.Errorf("%+v: time limits %v (want [hard 30, soft 10]) retries %v", o, got.TimeLimits, got.Retries)
		}
		if got.CorrelationID != base.ID || got.ReplyTo != "reply-q" || !reflect.DeepEqual(got.Callbacks, []string{"tasks.mul"}) {
			t.Errorf("%+v: correlation %q reply_to %q callbacks %v", o, got.CorrelationID, got.ReplyTo, got.Callbacks)
		}
		if wantProto == 2 {
			if got.RootID != "root-1" || got.ParentID != "parent-1" || got.IdempotencyKey != "order-42" ||
				!reflect.DeepEqual(got.Chain, []string{"tasks.last", "tasks.next"}) {
				t.Errorf("%+v: root %q parent %q key %q chain %v", o, got.RootID, got.ParentID, got.IdempotencyKey, got.Chain)
			}
		}
	}
	res := map[string]pyResult{}
	for _, r := range out.Results {
		if r.CorrelationID != r.TaskID {
			t.Errorf("%s: correlation id %q", r.TaskID, r.CorrelationID)
		}
		res[r.TaskID] = r
	}
	if r := res["r-success"]; r.State != "SUCCESS" || !reflect.DeepEqual(r.Value, map[string]any{"total": 5.0, "items": []any{"a", 1.5}}) {
		t.Errorf("success: %+v", r)
	}
	// want: module, class, the exception's args[0], str(exc) as Celery shows it.
	// An exc_module that cannot be imported gives a class made in celery.exceptions.
	for id, want := range map[string][4]string{
		"r-value":     {"builtins", "ValueError", "boom", "boom"},
		"r-notreg":    {"celery.exceptions", "NotRegistered", "tasks.nope", "'tasks.nope'"},
		"r-revoked":   {"celery.exceptions", "TaskRevokedError", "expired", "expired"},
		"r-timelimit": {"billiard.exceptions", "TimeLimitExceeded", "30", "TimeLimitExceeded('30',)"},
		"r-custom":    {"celery.exceptions", "PaymentDeclined", "card", "card"},
	} {
		r := res[id]
		if r.Raised == nil {
			t.Errorf("%s: nothing raised, state %s value %v", id, r.State, r.Value)
			continue
		}
		if len(r.Raised.Args) != 1 {
			t.Errorf("%s: exception args %q, want one", id, r.Raised.Args)
			continue
		}
		got := [4]string{r.Raised.Module, r.Raised.Type, r.Raised.Args[0], r.Raised.Str}
		if got != want || !r.Raised.IsException {
			t.Errorf("%s: Celery raised %v, want %v", id, got, want)
		}
	}
	if r := res["r-revoked"]; r.State != "REVOKED" {
		t.Errorf("revoked state %q", r.State)
	}
}
