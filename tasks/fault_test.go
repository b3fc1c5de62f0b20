package tasks

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// checkExactlyOnce asserts that every one of n operations had one effect.
func checkExactlyOnce(t *testing.T, fx *effects, n int, key func(int) string) {
	t.Helper()
	got := fx.snapshot()
	for i := range n {
		if c := got[key(i)]; c != 1 {
			t.Errorf("operation %s: %d effects, want 1", key(i), c)
		}
	}
	if len(got) != n {
		t.Errorf("%d operations had effects, want %d", len(got), n)
	}
}

// TestBrokerConnectionsClosedMidStream closes the worker's consuming and
// publishing connections from the broker in the middle of 1,000 tasks:
// every operation completes exactly once, every caller gets its result and
// the queue ends empty.
func TestBrokerConnectionsClosedMidStream(t *testing.T) {
	e := newEnv(t)
	fx := &effects{}
	cfg := e.config()
	cfg.Concurrency, cfg.Prefetch = 8, 32
	e.start(testRegistry(t, fx), cfg)
	replyTo, replies := e.replyQueue()

	const n = 1000
	key := func(i int) string { return fmt.Sprintf("rc-%d", i) }
	for i := range n {
		e.publish(payMessage("t.pay_slower", i, key(i), replyTo))
	}
	res := make(map[string][]map[string]any)
	collect := func(k int, timeout time.Duration) {
		for id, rs := range results(t, replies, k, timeout) {
			res[id] = append(res[id], rs...)
		}
	}
	pids := testkit.ConnectionPIDs(t, cfg.Broker.Name)
	if len(pids) != 2 {
		t.Fatalf("found %d connections named %s*, want 2 (consume and publish)", len(pids), cfg.Broker.Name)
	}
	collect(100, 60*time.Second)
	testkit.CloseConnections(t, pids)
	if len(res) >= n {
		t.Fatalf("all tasks were done before the connections closed: not a mid-stream test")
	}
	t.Logf("connections closed after %d of %d results", len(res), n)
	// Every task id answers at least once; a task answered just before the
	// close may answer twice (its redelivery is answered from the record).
	deadline := time.Now().Add(90 * time.Second)
	for len(res) < n && time.Now().Before(deadline) {
		select {
		case r := <-replies:
			id, _ := r["task_id"].(string)
			res[id] = append(res[id], r)
		case <-time.After(time.Second):
		}
	}
	if len(res) != n {
		t.Fatalf("%d of %d tasks answered", len(res), n)
	}
	checkPay(t, res, n, key)
	checkExactlyOnce(t, fx, n, key)
	testkit.WaitFor(t, "queue empty", 20*time.Second, func() bool { return e.queueDepth(e.queue) == 0 })
}

// TestDatabaseConnectionsKilledMidStream terminates the record's database
// connections (this test's own, by application_name) twice in the middle of
// 1,000 tasks: every operation completes exactly once and the queue empties.
func TestDatabaseConnectionsKilledMidStream(t *testing.T) {
	e := newEnv(t)
	app := testenv.Name("onceler_test")
	pcfg, err := pgxpool.ParseConfig(testenv.DatabaseURL(t))
	if err != nil {
		t.Fatal(err)
	}
	pcfg.ConnConfig.RuntimeParams["application_name"] = app
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	store, err := idempotency.New(pool, idempotency.Config{Schema: e.schema})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(store.Close)
	admin := testenv.Pool(t)
	kill := func() int {
		var n int
		err := admin.QueryRow(context.Background(),
			`SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1`, app).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}

	fx := &effects{}
	cfg := e.config()
	cfg.Store, cfg.Pool = store, pool
	cfg.Concurrency, cfg.Prefetch = 8, 32
	e.start(testRegistry(t, fx), cfg)
	replyTo, replies := e.replyQueue()
	const n = 1000
	key := func(i int) string { return fmt.Sprintf("db-%d", i) }
	for i := range n {
		e.publish(payMessage("t.pay_slow", i, key(i), replyTo))
	}
	res := make(map[string][]map[string]any)
	collect := func(k int, timeout time.Duration) {
		for id, rs := range results(t, replies, k, timeout) {
			res[id] = append(res[id], rs...)
		}
	}
	collect(200, 60*time.Second)
	t.Logf("terminated %d database connections", kill())
	collect(300, 60*time.Second)
	t.Logf("terminated %d database connections", kill())
	deadline := time.Now().Add(90 * time.Second)
	for len(res) < n && time.Now().Before(deadline) {
		select {
		case r := <-replies:
			id, _ := r["task_id"].(string)
			res[id] = append(res[id], r)
		case <-time.After(time.Second):
		}
	}
	if len(res) != n {
		t.Fatalf("%d of %d tasks answered", len(res), n)
	}
	checkPay(t, res, n, key)
	checkExactlyOnce(t, fx, n, key)
	testkit.WaitFor(t, "queue empty", 20*time.Second, func() bool { return e.queueDepth(e.queue) == 0 })
}
