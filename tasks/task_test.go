package tasks

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceler/onceler/idempotency"
)

type chargeArgs struct {
	OrderID  string `celery:"order_id"`
	Amount   int64
	Currency string   `json:"currency,omitempty"`
	Note     *string  // optional: pointer
	Tags     []string `celery:"tags,optional"`
}

func noRun(context.Context, *Call, chargeArgs) (any, error) { return nil, nil }

func TestRegisterRefusesUnsafeTasks(t *testing.T) {
	t.Parallel()
	key := func(a chargeArgs) (string, error) { return a.OrderID, nil }
	runTx := func(context.Context, pgx.Tx, *Call, chargeArgs) (any, error) { return nil, nil }
	lookup := func(context.Context, *Call, chargeArgs) (any, bool, error) { return nil, false, nil }
	runStmt := func(*Call, chargeArgs) (Stmt, error) { return Stmt{SQL: "SELECT 1"}, nil }
	cases := []struct {
		name string
		task Task[chargeArgs]
		want string
	}{
		{"no name", Task[chargeArgs]{Run: noRun}, "empty task name"},
		{"outside without key", Task[chargeArgs]{Name: "a", Mode: ModeOutside, Run: noRun}, "without Key"},
		{"same-db without key", Task[chargeArgs]{Name: "a", Mode: ModeSameDB, RunTx: runTx}, "without Key"},
		{"same-db without RunTx", Task[chargeArgs]{Name: "a", Mode: ModeSameDB, Key: key, Run: noRun}, "without RunTx"},
		{"pure without Run", Task[chargeArgs]{Name: "a"}, "without Run"},
		{"lookup without Lookup", Task[chargeArgs]{Name: "a", Mode: ModeOutside, Key: key, Run: noRun, Policy: PolicyLookup}, "without Lookup"},
		{"fallback lookup", Task[chargeArgs]{Name: "a", Mode: ModeOutside, Key: key, Run: noRun, Policy: PolicyLookup, Lookup: lookup, Fallback: PolicyLookup}, "fallback"},
		{"RunTx outside same-db", Task[chargeArgs]{Name: "a", Mode: ModeOutside, Key: key, Run: noRun, RunTx: runTx}, "only for ModeSameDB"},
		{"RunStmt outside same-db", Task[chargeArgs]{Name: "a", Mode: ModeOutside, Key: key, Run: noRun, RunStmt: runStmt}, "only for ModeSameDB"},
		{"same-db with RunTx and RunStmt", Task[chargeArgs]{Name: "a", Mode: ModeSameDB, Key: key, RunTx: runTx, RunStmt: runStmt}, "both RunTx and RunStmt"},
		{"same-db RunStmt without key", Task[chargeArgs]{Name: "a", Mode: ModeSameDB, RunStmt: runStmt}, "without Key"},
		{"unknown mode", Task[chargeArgs]{Name: "a", Mode: Mode(9), Key: key, Run: noRun}, "unknown mode"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := Register(NewRegistry(), tc.task)
			if !errors.Is(err, ErrInvalidTask) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Register = %v, want ErrInvalidTask mentioning %q", err, tc.want)
			}
		})
	}

	r := NewRegistry()
	if err := Register(r, Task[chargeArgs]{Name: "billing.charge", Mode: ModeOutside, Key: key, Run: noRun,
		Policy: PolicyLookup, Lookup: lookup, Fallback: PolicySkip}); err != nil {
		t.Fatalf("valid task refused: %v", err)
	}
	err := Register(r, Task[chargeArgs]{Name: "billing.charge", Run: noRun})
	if !errors.Is(err, ErrDuplicateTask) {
		t.Fatalf("duplicate name: got %v", err)
	}
	if err := Register(r, Task[int]{Name: "x", Run: func(context.Context, *Call, int) (any, error) { return nil, nil }}); !errors.Is(err, ErrInvalidTask) {
		t.Fatalf("non-struct argument type: got %v", err)
	}
	if got := r.Names(); len(got) != 1 || got[0] != "billing.charge" {
		t.Fatalf("Names = %v", got)
	}
}

func bindCharge(t *testing.T, args []any, kwargs map[string]any) (chargeArgs, error) {
	t.Helper()
	r := NewRegistry()
	if err := Register(r, Task[chargeArgs]{Name: "c", Run: noRun}); err != nil {
		t.Fatal(err)
	}
	h, _ := r.get("c")
	v, err := h.bind(args, kwargs)
	if err != nil {
		return chargeArgs{}, err
	}
	return v.(chargeArgs), nil
}

func TestBindPositionalAndKeyword(t *testing.T) {
	t.Parallel()
	a, err := bindCharge(t, []any{"o-1", int64(250)}, map[string]any{"currency": "EUR", "note": "n", "tags": []any{"x", "y"}})
	if err != nil {
		t.Fatal(err)
	}
	if a.OrderID != "o-1" || a.Amount != 250 || a.Currency != "EUR" || a.Note == nil || *a.Note != "n" ||
		len(a.Tags) != 2 || a.Tags[1] != "y" {
		t.Fatalf("bound %+v", a)
	}
	a, err = bindCharge(t, nil, map[string]any{"order_id": "o-2", "amount": 3.0})
	if err != nil {
		t.Fatal(err)
	}
	if a.OrderID != "o-2" || a.Amount != 3 || a.Note != nil || a.Currency != "" {
		t.Fatalf("bound %+v", a)
	}
}

func TestBindErrors(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name   string
		args   []any
		kwargs map[string]any
		want   string
	}{
		{"missing", []any{"o"}, nil, "argument amount: missing required argument"},
		{"wrong type", []any{"o", "sekret-ten"}, nil, "argument amount: expected int64, got str"},
		{"fraction", []any{"o", 2.5}, nil, "argument amount: expected int64, got float"},
		{"too many", []any{"o", int64(1), "EUR", "n", []any{}, "extra"}, nil, "takes 5 positional arguments but 6 were given"},
		{"unknown kwarg", []any{"o", int64(1)}, map[string]any{"colour": "sekret-red"}, "argument colour: unexpected keyword argument"},
		{"twice", []any{"o", int64(1)}, map[string]any{"order_id": "p"}, "argument order_id: got multiple values"},
		{"null required", []any{nil, int64(1)}, nil, "argument order_id: expected string, got None"},
		{"list element", []any{"o", int64(1)}, map[string]any{"tags": []any{"a", int64(2)}}, "argument tags[1]: expected string, got int"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := bindCharge(t, tc.args, tc.kwargs)
			if !IsBadArguments(err) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("bind = %v, want bad arguments %q", err, tc.want)
			}
			if strings.Contains(err.Error(), "sekret") {
				t.Fatalf("error leaks an argument value: %v", err)
			}
		})
	}
}

func TestBindNestedAndTypes(t *testing.T) {
	t.Parallel()
	type item struct {
		SKU string
		Qty uint8
	}
	type args struct {
		Items  []item
		Meta   map[string]int
		When   time.Time
		Raw    []byte
		Any    any
		Ratio  float32
		Flag   bool
		Ignore string `celery:"-"`
	}
	r := NewRegistry()
	if err := Register(r, Task[args]{Name: "n", Run: func(context.Context, *Call, args) (any, error) { return nil, nil }}); err != nil {
		t.Fatal(err)
	}
	h, _ := r.get("n")
	v, err := h.bind([]any{
		[]any{map[string]any{"sku": "a", "qty": int64(2)}},
		map[string]any{"x": int64(1)},
		"2024-05-01T12:00:00.123456+00:00",
		[]byte("hi"),
		[]any{int64(1)},
		int64(2),
		true,
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	a := v.(args)
	if a.Items[0].SKU != "a" || a.Items[0].Qty != 2 || a.Meta["x"] != 1 || a.When.Nanosecond() != 123456000 ||
		string(a.Raw) != "hi" || a.Ratio != 2 || !a.Flag {
		t.Fatalf("bound %+v", a)
	}
	_, err = h.bind([]any{[]any{map[string]any{"sku": "a", "qty": int64(300)}}}, nil)
	if !IsBadArguments(err) || !strings.Contains(err.Error(), "items[0].qty: integer out of range") {
		t.Fatalf("overflow: %v", err)
	}
}

func TestSnakeCase(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{"OrderID": "order_id", "Amount": "amount", "HTTPServer": "http_server", "A": "a", "userName2": "user_name2"} {
		if got := snakeCase(in); got != want {
			t.Errorf("snakeCase(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestExceptionFor(t *testing.T) {
	t.Parallel()
	cases := []struct {
		err            error
		typ, mod, text string
	}{
		{ValueError("bad amount"), "ValueError", "builtins", "bad amount"},
		{KeyError("k"), "KeyError", "builtins", "k"},
		{PyError("CardDeclined", "payments.errors", "no"), "CardDeclined", "payments.errors", "no"},
		{errors.New("boom"), "Exception", "builtins", "boom"},
		{&ArgumentError{Task: "t", Arg: "a", Reason: "missing required argument"}, "TypeError", "builtins", "bad arguments for t: argument a: missing required argument"},
	}
	for _, tc := range cases {
		e := exceptionFor(tc.err)
		if e.Type != tc.typ || e.Module != tc.mod || e.Message != tc.text {
			t.Errorf("exceptionFor(%v) = %+v", tc.err, e)
		}
	}
	c := &Call{}
	if err := c.Retry(0, nil); !IsRetry(err) || err.(*RetryRequest).Countdown != 180*time.Second {
		t.Errorf("default retry: %v", err)
	}
}

func TestMetricsRegistration(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	m, err := newMetrics(reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	m.received.WithLabelValues("x").Inc()
	m.stale.WithLabelValues("x", "hold").Inc()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for _, mf := range mfs {
		names[mf.GetName()] = true
	}
	for _, n := range []string{"onceler_tasks_received_total", "onceler_stale_claims_total", "onceler_tasks_in_flight"} {
		if !names[n] {
			t.Errorf("metric %s not gathered (have %v)", n, names)
		}
	}
	if _, err := newMetrics(reg, nil); err == nil {
		t.Error("second worker on the same registry accepted")
	}
}

// TestRegisterRefusesNamesTheRecordCannotKeep: a task with a record and a
// name beyond idempotency.MaxTaskBytes is refused at registration, not at
// every claim.
func TestRegisterRefusesNamesTheRecordCannotKeep(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("n", idempotency.MaxTaskBytes+1)
	err := Register(NewRegistry(), Task[opArgs]{Name: long, Mode: ModeOutside, Key: opKey,
		Run: func(context.Context, *Call, opArgs) (any, error) { return nil, nil }})
	if !errors.Is(err, ErrInvalidTask) {
		t.Errorf("long name registered: %v", err)
	}
	if err := Register(NewRegistry(), Task[opArgs]{Name: long, Run: func(context.Context, *Call, opArgs) (any, error) { return nil, nil }}); err != nil {
		t.Errorf("long name of a pure task (no record): %v", err)
	}
}
