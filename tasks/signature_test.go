package tasks

import (
	"regexp"
	"testing"
)

func TestStepID(t *testing.T) {
	t.Parallel()
	a, b := stepID("parent", "link", 0), stepID("parent", "link", 1)
	if a != stepID("parent", "link", 0) || a == b || a == stepID("other", "link", 0) {
		t.Errorf("step ids not stable and distinct: %s %s", a, b)
	}
	if !regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`).MatchString(a) {
		t.Errorf("step id %s is not a version 4 UUID", a)
	}
}

func TestOptSignatures(t *testing.T) {
	t.Parallel()
	one := map[string]any{"task": "t.cb", "args": []any{int64(1)}, "kwargs": map[string]any{}, "options": map[string]any{"task_id": "x"},
		"subtask_type": nil, "immutable": true}
	got, err := optSignatures(map[string]any{"link": one}, "link")
	if err != nil || len(got) != 1 || got[0].Task != "t.cb" || got[0].TaskID() != "x" || !got[0].Immutable {
		t.Fatalf("single: %+v %v", got, err)
	}
	got, err = optSignatures(map[string]any{"link": []any{one, one}}, "link")
	if err != nil || len(got) != 2 {
		t.Fatalf("list: %+v %v", got, err)
	}
	for _, bad := range []any{"t.cb", []any{"t.cb"}, map[string]any{"args": []any{}}, map[string]any{"task": "t", "args": "x"}} {
		if _, err := optSignatures(map[string]any{"link": bad}, "link"); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
	if got, err := optSignatures(map[string]any{}, "link"); err != nil || got != nil {
		t.Errorf("absent: %v %v", got, err)
	}
}

func TestWithoutBrokerHeaders(t *testing.T) {
	t.Parallel()
	h := map[string]any{"idempotency_key": "k", "x-delivery-count": int64(3), "x-death": []any{}, "x-first-death-queue": "q", "x-custom": "keep"}
	got := withoutBrokerHeaders(h)
	if len(got) != 2 || got["idempotency_key"] != "k" || got["x-custom"] != "keep" {
		t.Errorf("withoutBrokerHeaders = %v", got)
	}
	if len(h) != 5 {
		t.Errorf("input changed: %v", h)
	}
	clean := map[string]any{"a": 1}
	if got := withoutBrokerHeaders(clean); len(got) != 1 {
		t.Errorf("clean headers changed: %v", got)
	}
}
