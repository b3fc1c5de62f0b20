package demo

import (
	"context"
	"encoding/json"
	"errors"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"
	"go.uber.org/zap/zaptest"

	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/tasks"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func newDemo(t *testing.T) *demo {
	t.Helper()
	pool := testenv.Pool(t)
	if err := Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	return &demo{pool: pool, log: zaptest.NewLogger(t)}
}

func TestMigrateConcurrentAndRepeated(t *testing.T) {
	pool := testenv.Pool(t)
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = Migrate(ctx, pool)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	for _, table := range []string{"ledger", "balances", "gateway_calls", "gateway_charges", "email_sends", "sleeps"} {
		var ok bool
		if err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, Schema+"."+table).Scan(&ok); err != nil || !ok {
			t.Fatalf("table %s missing after Migrate (err %v)", table, err)
		}
	}
}

func TestRegisterAllTasks(t *testing.T) {
	reg := tasks.NewRegistry()
	if err := Register(reg, nil); err != nil {
		t.Fatal(err)
	}
	got := reg.Names()
	want := map[string]bool{}
	for _, n := range Names() {
		want[n] = true
	}
	if len(got) != len(want) {
		t.Fatalf("registered %v, want %v", got, Names())
	}
	for _, n := range got {
		if !want[n] {
			t.Fatalf("unexpected task %q", n)
		}
	}
	if err := Register(reg, nil); !errors.Is(err, tasks.ErrDuplicateTask) {
		t.Fatalf("second Register: got %v, want ErrDuplicateTask", err)
	}
}

func TestAdd(t *testing.T) {
	d := &demo{}
	got, err := d.add(context.Background(), &tasks.Call{}, AddArgs{X: 2, Y: 3})
	if err != nil || got != int64(5) {
		t.Fatalf("add(2, 3) = %v (%T), %v; want 5", got, got, err)
	}
	got, _ = d.add(context.Background(), &tasks.Call{}, AddArgs{X: 0.5, Y: 1})
	if got != 1.5 {
		t.Fatalf("add(0.5, 1) = %v, want 1.5", got)
	}
}

func TestXsum(t *testing.T) {
	d := &demo{}
	for _, c := range []struct {
		in   []float64
		want any
	}{{[]float64{3, 7, 11}, int64(21)}, {nil, int64(0)}, {[]float64{0.5, 1}, 1.5}} {
		got, err := d.xsum(context.Background(), &tasks.Call{}, XsumArgs{Numbers: c.in})
		if err != nil || got != c.want {
			t.Errorf("xsum(%v) = %v (%T), %v; want %v", c.in, got, got, err, c.want)
		}
	}
}

func TestCreditWritesInTheGivenTransaction(t *testing.T) {
	d := newDemo(t)
	ctx := context.Background()
	account, e1, e2 := testenv.Name("acct"), testenv.Name("e"), testenv.Name("e")

	credit := func(entry string, cents int64, commit bool) CreditResult {
		t.Helper()
		tx, err := d.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(ctx) }()
		st, err := d.credit(&tasks.Call{TaskID: "t-" + entry, Key: entry}, CreditArgs{Account: account, EntryID: entry, Cents: cents})
		if err != nil {
			t.Fatal(err)
		}
		res, err := st.Result(tx.QueryRow(ctx, st.SQL, st.Args...))
		if err != nil {
			t.Fatal(err)
		}
		if commit {
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
		}
		return res.(CreditResult)
	}
	if r := credit(e1, 1500, true); r.Balance != 1500 || r.EntryID != e1 || r.Account != account {
		t.Fatalf("first credit = %+v", r)
	}
	// A rolled-back transaction leaves no effect: the ledger lives in the
	// record's transaction.
	if r := credit(e2, 99, false); r.Balance != 1599 {
		t.Fatalf("uncommitted credit balance = %d, want 1599", r.Balance)
	}
	if n, err := CountLedger(ctx, d.pool, e2); err != nil || n != 0 {
		t.Fatalf("rolled back entry count = %d, %v; want 0", n, err)
	}
	if r := credit(e2, 250, true); r.Balance != 1750 {
		t.Fatalf("second credit balance = %d, want 1750", r.Balance)
	}
	if b, err := Balance(ctx, d.pool, account); err != nil || b != 1750 {
		t.Fatalf("Balance = %d, %v; want 1750", b, err)
	}
	// The account's balance row, which the credits update, agrees.
	var kept int64
	if err := d.pool.QueryRow(ctx, `SELECT cents FROM onceler_demo.balances WHERE account = $1`, account).Scan(&kept); err != nil || kept != 1750 {
		t.Fatalf("balance row = %d, %v; want 1750", kept, err)
	}
}

func TestChargeGatewayDeduplicatesByReference(t *testing.T) {
	d := newDemo(t)
	ctx := context.Background()
	order := testenv.Name("order")
	args := ChargeArgs{OrderID: order, Cents: 4200}
	c := &tasks.Call{TaskID: "t1", Key: order}

	if _, found, err := d.lookupCharge(ctx, c, args); err != nil || found {
		t.Fatalf("lookup before charge: found %v, err %v", found, err)
	}
	for range 2 {
		res, err := d.charge(ctx, c, args)
		if err != nil {
			t.Fatal(err)
		}
		if r := res.(ChargeResult); r.OrderID != order || r.ChargeID != "charge:"+order {
			t.Fatalf("charge = %+v", r)
		}
	}
	if n, _ := CountGatewayCalls(ctx, d.pool, order); n != 2 {
		t.Fatalf("gateway calls = %d, want 2", n)
	}
	if n, _ := CountGatewayCharges(ctx, d.pool, order); n != 1 {
		t.Fatalf("gateway charges = %d, want 1", n)
	}
	res, found, err := d.lookupCharge(ctx, c, args)
	if err != nil || !found || res.(ChargeResult).ChargeID != ChargeReference(order) {
		t.Fatalf("lookup after charge: %v %v %v", res, found, err)
	}
}

func TestEmailKeepsEverySend(t *testing.T) {
	d := newDemo(t)
	ctx := context.Background()
	msg := testenv.Name("msg")
	for range 2 {
		if _, err := d.email(ctx, &tasks.Call{TaskID: "t", Key: msg}, EmailArgs{MessageID: msg, To: "a@example.com", Subject: "hi"}); err != nil {
			t.Fatal(err)
		}
	}
	if n, _ := CountEmailSends(ctx, d.pool, msg); n != 2 {
		t.Fatalf("email sends = %d, want 2", n)
	}
}

func TestSleepStopsOnCancel(t *testing.T) {
	d := newDemo(t)
	op := testenv.Name("op")
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	err := pgx.BeginFunc(context.Background(), d.pool, func(tx pgx.Tx) error {
		_, err := d.sleep(ctx, tx, &tasks.Call{TaskID: "t", Key: op}, SleepArgs{Op: op, Seconds: 30})
		return err
	})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("sleep under a 100ms deadline: %v", err)
	}
	err = pgx.BeginFunc(context.Background(), d.pool, func(tx pgx.Tx) error {
		_, err := d.sleep(context.Background(), tx, &tasks.Call{TaskID: "t", Key: op}, SleepArgs{Op: op, Seconds: 0.01})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if n, _ := CountSleeps(context.Background(), d.pool, op); n != 1 {
		t.Fatalf("sleeps = %d, want 1", n)
	}
}

func TestFlakyRetriesThenSucceeds(t *testing.T) {
	d := &demo{log: zaptest.NewLogger(t)}
	for retries := range 3 {
		res, err := d.flaky(context.Background(), &tasks.Call{Retries: retries}, FlakyArgs{Op: "op", Failures: 2})
		if retries < 2 {
			if !tasks.IsRetry(err) || !errors.Is(err, ErrFlaky) {
				t.Fatalf("retries %d: got %v, want a retry request", retries, err)
			}
			continue
		}
		if err != nil || res.(FlakyResult) != (FlakyResult{Op: "op", Attempts: 3}) {
			t.Fatalf("retries %d: %v %v", retries, res, err)
		}
	}
}

func TestFailIsValueError(t *testing.T) {
	_, err := (&demo{}).fail(context.Background(), &tasks.Call{}, FailArgs{Message: "bad input"})
	var pe *tasks.PythonError
	if !errors.As(err, &pe) || pe.Type != "ValueError" || pe.Module != "builtins" || pe.Message != "bad input" {
		t.Fatalf("fail: %#v", err)
	}
}

func TestAddAsPython(t *testing.T) {
	d := &demo{}
	for _, c := range []struct {
		x, y any
		want string // the result's JSON
	}{
		{int64(100_000_000_000_000_000), int64(1), "100000000000000001"},
		{int64(1), 2.0, "3.0"},
		{2.0, 3.0, "5.0"},
		{0.5, int64(1), "1.5"},
		{true, int64(1), "2"},
		{int64(math.MaxInt64), int64(1), "9223372036854775808"},
		{1e16, 0.0, "1e+16"},
		{-1.0, 0.0, "-1.0"},
	} {
		got, err := d.add(context.Background(), &tasks.Call{}, AddArgs{X: c.x, Y: c.y})
		if err != nil {
			t.Fatalf("add(%v, %v): %v", c.x, c.y, err)
		}
		b, err := json.Marshal(got)
		if err != nil || string(b) != c.want {
			t.Errorf("add(%v, %v) = %s, %v; want %s", c.x, c.y, b, err, c.want)
		}
	}
	if _, err := d.add(context.Background(), &tasks.Call{}, AddArgs{X: int64(1), Y: "a"}); err == nil ||
		err.Error() != "TypeError: unsupported operand type(s) for +: 'int' and 'str'" {
		t.Errorf("add(1, 'a') = %v", err)
	}
}
