package control

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	amqp091 "github.com/onceler/onceler/internal/amqp091"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/clip"
	"github.com/onceler/onceler/internal/testenv"
)

// logSink records the length of every log line and keeps a short head of
// each, so that a test can bound the log without printing megabytes.
type logSink struct {
	mu    sync.Mutex
	lines []string
	max   int
}

func (s *logSink) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for line := range bytes.Lines(p) {
		s.max = max(s.max, len(line))
		s.lines = append(s.lines, clip.String(string(line), 300))
	}
	return len(p), nil
}

func (s *logSink) Sync() error { return nil }

func (s *logSink) longest() (int, []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.max, slices.Clone(s.lines)
}

func sinkLogger(s *logSink) *zap.Logger {
	return zap.New(zapcore.NewCore(zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()), s, zap.DebugLevel))
}

func manyIDs(prefix string, n int) []any {
	ids := make([]any, n)
	for i := range ids {
		ids[i] = prefix + strconv.Itoa(i)
	}
	return ids
}

// runWithin runs f and fails the test when it takes longer than d.
func runWithin(t *testing.T, d time.Duration, what string, f func()) time.Duration {
	t.Helper()
	done := make(chan struct{})
	start := time.Now()
	go func() { defer close(done); f() }()
	select {
	case <-done:
	case <-time.After(d):
		t.Errorf("%s took longer than %v", what, d)
		<-done
	}
	return time.Since(start)
}

func TestRevokeManyIDsIsLinearAndBounded(t *testing.T) {
	sink := &logSink{}
	c := newUnitController(t, Config{Logger: sinkLogger(sink)})
	w := c.worker().(*testWorker)
	w.active["id-5"] = &running{info: TaskInfo{ID: "id-5", Name: "demo.sleep"}, cancel: func(error) {}}
	var res any
	ids := manyIDs("id-", 300_000)
	el := runWithin(t, 3*time.Second, "revoke of 300,000 ids", func() {
		res, _ = c.dispatch(context.Background(), &celeryproto.ControlRequest{Method: "revoke", Arguments: map[string]any{"task_id": ids}})
	})
	t.Logf("revoke of 300,000 ids: %v", el)
	msg, _ := res.(map[string]any)["ok"].(string)
	if !strings.HasPrefix(msg, "tasks id-0, id-1, id-2, ") || !strings.HasSuffix(msg, " more flagged as revoked") || len(msg) > revokeReplyBytes+100 {
		t.Errorf("reply of %d bytes: %.200q ... %.100q", len(msg), msg, msg[max(0, len(msg)-100):])
	}
	listed := strings.Count(msg, ", ") + 1
	if want := fmt.Sprintf(" and %d more flagged", 300_000-listed); !strings.Contains(msg, want) {
		t.Errorf("reply does not count the ids left out (%q): %q", want, msg[max(0, len(msg)-100):])
	}
	// The set keeps the last 50,000 given, as a set bounded at 50,000 does.
	if got := c.Revoked().Len(); got != DefaultRevokedMax {
		t.Errorf("revoked set holds %d ids, want %d", got, DefaultRevokedMax)
	}
	if !c.Revoked().Contains("id-299999") || !c.Revoked().Contains("id-250000") || c.Revoked().Contains("id-249999") {
		t.Error("revoked set does not hold the last 50,000 ids given")
	}
	if !w.revoked.Contains("id-299999") {
		t.Error("worker not told of the revoked ids")
	}
	longest, lines := sink.longest()
	if longest > 2048 || len(lines) != 1 || !strings.Contains(lines[0], `"count":300000`) {
		t.Errorf("log: longest line %d bytes, lines %q", longest, lines)
	}

	// terminate reaches a running task named before the last 50,000
	terminated := make(chan error, 1)
	w.active["id-5"].cancel = func(err error) { terminated <- err }
	runWithin(t, 3*time.Second, "terminate of 300,000 ids", func() {
		res, _ = c.dispatch(context.Background(), &celeryproto.ControlRequest{Method: "revoke", Arguments: map[string]any{"task_id": ids, "terminate": true}})
	})
	if !jsonEqual(res, ok("terminate: id-5")) || len(terminated) != 1 {
		t.Errorf("terminate = %v, cancelled %d", res, len(terminated))
	}

	// duplicates are listed once, as Celery's set lists them
	res, _ = c.dispatch(context.Background(), &celeryproto.ControlRequest{Method: "revoke", Arguments: map[string]any{"task_id": []any{"a", "b", "a"}}})
	if !jsonEqual(res, ok("tasks a, b flagged as revoked")) {
		t.Errorf("revoke with a duplicate = %v", res)
	}
	// an id longer than the reply's bound is counted, not listed
	res, _ = c.dispatch(context.Background(), &celeryproto.ControlRequest{Method: "revoke", Arguments: map[string]any{"task_id": strings.Repeat("x", 10_000)}})
	if !jsonEqual(res, ok("tasks 1 id flagged as revoked")) {
		t.Errorf("revoke of a long id = %.200v", res)
	}

	// a mingle hello with more ids than the set holds keeps the newest
	rv := make(map[string]any, 120_000)
	for i := range 120_000 {
		rv["h-"+strconv.Itoa(i)] = float64(1_700_000_000 + i)
	}
	runWithin(t, 3*time.Second, "hello with 120,000 revoked ids", func() {
		_, _ = c.dispatch(context.Background(), &celeryproto.ControlRequest{Method: "hello", Arguments: map[string]any{"from_node": "celery@py", "revoked": rv}})
	})
	if !c.Revoked().Contains("h-119999") || !c.Revoked().Contains("h-70000") || c.Revoked().Contains("h-69999") {
		t.Error("hello did not keep the newest 50,000 revoked ids")
	}
}

func TestRevokeStopsAtShutdown(t *testing.T) {
	c := newUnitController(t, Config{})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	res, _ := c.dispatch(ctx, &celeryproto.ControlRequest{Method: "revoke", Arguments: map[string]any{"task_id": manyIDs("s-", 10_000)}})
	if !jsonEqual(res, nok("revoke: interrupted by shutdown")) {
		t.Errorf("revoke after shutdown began = %v", res)
	}
}

// pidboxClient publishes remote-control requests as kombu's Mailbox does and
// collects the replies, through amqp091-go.
type pidboxClient struct {
	ch      *amqp091.Channel
	key     string
	replies chan amqp091.Delivery
}

func newPidboxClient(t *testing.T, url string) *pidboxClient {
	t.Helper()
	conn, err := amqp091.Dial(url)
	if err != nil {
		testenv.Unavailable(t, "broker: %v", err)
	}
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.ExchangeDeclare(PidboxExchange, "fanout", false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := ch.ExchangeDeclare(ReplyExchange, "direct", false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	q, err := ch.QueueDeclare("", false, true, true, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	key := testenv.Name("reply")
	if err := ch.QueueBind(q.Name, key, ReplyExchange, false, nil); err != nil {
		t.Fatal(err)
	}
	ds, err := ch.Consume(q.Name, "", true, true, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	p := &pidboxClient{ch: ch, key: key, replies: make(chan amqp091.Delivery, 100)}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for d := range ds {
			select {
			case p.replies <- d:
			default:
				t.Error("pidbox client: reply overflow")
			}
		}
	}()
	t.Cleanup(func() { _ = conn.Close(); <-done })
	return p
}

// send publishes method with arguments to node and returns its ticket.
func (p *pidboxClient) send(t *testing.T, node, method string, args map[string]any) string {
	t.Helper()
	ticket := testenv.Name("ticket")
	body, err := json.Marshal(map[string]any{
		"method": method, "arguments": args, "destination": []string{node}, "pattern": nil, "matcher": nil,
		"ticket": ticket, "reply_to": map[string]any{"exchange": ReplyExchange, "routing_key": p.key},
	})
	if err != nil {
		t.Fatal(err)
	}
	err = p.ch.PublishWithContext(context.Background(), PidboxExchange, "", false, false, amqp091.Publishing{
		ContentType: "application/json", ContentEncoding: "utf-8", Body: body,
		Headers: amqp091.Table{"clock": int32(1), "expires": float64(time.Now().Add(time.Minute).Unix())},
	})
	if err != nil {
		t.Fatal(err)
	}
	return ticket
}

// await returns the replies of node to the tickets, failing past within.
func (p *pidboxClient) await(t *testing.T, node string, within time.Duration, tickets ...string) map[string]any {
	t.Helper()
	out := map[string]any{}
	timeout := time.After(within)
	for len(out) < len(tickets) {
		select {
		case d := <-p.replies:
			tk, _ := d.Headers["ticket"].(string)
			var body map[string]any
			if err := json.Unmarshal(d.Body, &body); err != nil {
				t.Fatalf("reply %q: %v", d.Body, err)
			}
			if len(d.Body) > 16<<10 {
				t.Errorf("reply to %s is %d bytes", tk, len(d.Body))
			}
			out[tk] = body[node]
		case <-timeout:
			t.Fatalf("replies to %v: got %d within %v", tickets, len(out), within)
		}
	}
	return out
}

// heartbeats records when worker-heartbeats arrive.
func heartbeats(evs <-chan rawEvent, stop <-chan struct{}) <-chan []time.Time {
	out := make(chan []time.Time, 1)
	go func() {
		var ts []time.Time
		for {
			select {
			case ev := <-evs:
				if ev.fields["type"] == "worker-heartbeat" {
					ts = append(ts, time.Now())
				}
			case <-stop:
				out <- ts
				return
			}
		}
	}()
	return out
}

func TestLargeRevokeKeepsControlResponsive(t *testing.T) {
	n := newNode(t, false)
	sink := &logSink{}
	n.ctl.log = sinkLogger(sink).With(zap.String("node", n.name))
	evs := watchWorkerEvents(t, n.url, n.name)
	n.start(t)
	if ev := nextEvent(t, evs, 5*time.Second); ev.fields["type"] != "worker-online" {
		t.Fatalf("first event %v", ev.fields)
	}
	p := newPidboxClient(t, n.url)
	stopBeats := make(chan struct{})
	beats := heartbeats(evs, stopBeats)
	start := time.Now()

	// Decoding the 1,000,000 ids (an 18 MB body) takes about 0.5 s, but 5 s
	// and more under the race detector on a loaded 2-core machine; handling
	// them as the 100,000 were (string concatenation) would take hours.
	for _, tc := range []struct {
		size  int
		limit time.Duration
	}{{100_000, 5 * time.Second}, {1_000_000, 15 * time.Second}} {
		size := tc.size
		t0 := time.Now()
		rt := p.send(t, n.name, "revoke", map[string]any{"task_id": manyIDs(fmt.Sprintf("r%d-", size), size)})
		pt := p.send(t, n.name, "ping", nil)
		sent := time.Since(t0)
		got := p.await(t, n.name, 10*time.Second, rt, pt)
		el := time.Since(t0)
		t.Logf("revoke of %d ids: published in %v, answered (and the ping after it) in %v", size, sent, el)
		if el-sent > tc.limit {
			t.Errorf("revoke of %d ids: replies %v after publishing", size, el-sent)
		}
		msg, _ := got[rt].(map[string]any)["ok"].(string)
		if !strings.HasPrefix(msg, fmt.Sprintf("tasks r%d-0, r%d-1, ", size, size)) || !strings.HasSuffix(msg, "more flagged as revoked") {
			t.Errorf("revoke reply %.200q", msg)
		}
		if !jsonEqual(got[pt], ok("pong")) {
			t.Errorf("ping = %v", got[pt])
		}
		last := fmt.Sprintf("r%d-%d", size, size-1)
		if !n.ctl.Revoked().Contains(last) || n.ctl.Revoked().Len() != DefaultRevokedMax {
			t.Errorf("revoked set: %d ids, holds the last: %v", n.ctl.Revoked().Len(), n.ctl.Revoked().Contains(last))
		}
	}
	// heartbeats kept coming all along, every 2 s
	time.Sleep(3 * time.Second)
	close(stopBeats)
	ts := <-beats
	prev := start
	for _, at := range append(ts, time.Now()) {
		if gap := at.Sub(prev); gap > 4*time.Second {
			t.Errorf("no worker-heartbeat for %v (heartbeats at %v after start)", gap, offsets(start, ts))
		}
		prev = at
	}
	longest, lines := sink.longest()
	if longest > 2048 {
		t.Errorf("a log line of %d bytes", longest)
	}
	for _, l := range lines {
		t.Logf("log: %s", strings.TrimSpace(l))
	}

	// shutdown is obeyed promptly while a large revoke is being handled
	p.send(t, n.name, "revoke", map[string]any{"task_id": manyIDs("s-", 1_000_000)})
	time.Sleep(200 * time.Millisecond)
	el := runWithin(t, 5*time.Second, "stop during a revoke of 1,000,000 ids", n.stop)
	t.Logf("stopped in %v", el)
}

func offsets(start time.Time, ts []time.Time) []string {
	out := make([]string, len(ts))
	for i, at := range ts {
		out[i] = at.Sub(start).Round(100 * time.Millisecond).String()
	}
	return out
}

func TestCeleryRevokeManyIDs(t *testing.T) {
	n := startNode(t, false)
	res := n.client(t, "revoke-many", "100000")
	if el, _ := res["elapsed"].(float64); el > 5 {
		t.Errorf("app.control.revoke of 100,000 ids answered in %.1fs", el)
	}
	reply, _ := res["reply"].([]any)
	if len(reply) != 1 {
		t.Fatalf("replies %v", res["reply"])
	}
	msg, _ := reply[0].(map[string]any)[n.name].(map[string]any)["ok"].(string)
	if !strings.HasPrefix(msg, "tasks ") || !strings.HasSuffix(msg, "more flagged as revoked") {
		t.Errorf("reply %.300q", msg)
	}
	if ping, _ := res["ping"].([]any); len(ping) != 1 || !jsonEqual(ping[0], map[string]any{n.name: ok("pong")}) {
		t.Errorf("ping after the revoke = %v", res["ping"])
	}
	if n.ctl.Revoked().Len() != DefaultRevokedMax {
		t.Errorf("revoked set holds %d ids", n.ctl.Revoked().Len())
	}
}

// slowRevoke is a Worker whose Revoke of the id "slow" takes a while.
type slowRevoke struct {
	*testWorker
	d time.Duration
}

func (w slowRevoke) Revoke(ids []string, terminate bool) {
	if slices.Contains(ids, "slow") {
		time.Sleep(w.d)
	}
	w.testWorker.Revoke(ids, terminate)
}

func TestSlowCommandDoesNotDelayHeartbeats(t *testing.T) {
	n := newNode(t, false)
	n.ctl.SetWorker(slowRevoke{n.worker, 7 * time.Second})
	evs := watchWorkerEvents(t, n.url, n.name)
	n.start(t)
	if ev := nextEvent(t, evs, 5*time.Second); ev.fields["type"] != "worker-online" {
		t.Fatalf("first event %v", ev.fields)
	}
	p := newPidboxClient(t, n.url)
	start := time.Now()
	rt := p.send(t, n.name, "revoke", map[string]any{"task_id": "slow"})
	stop := make(chan struct{})
	beats := heartbeats(evs, stop)
	got := p.await(t, n.name, 15*time.Second, rt)
	close(stop)
	if el := time.Since(start); el < 7*time.Second {
		t.Fatalf("the slow revoke answered in %v: not slow", el)
	}
	if !jsonEqual(got[rt], ok("tasks slow flagged as revoked")) {
		t.Errorf("revoke = %v", got[rt])
	}
	if ts := <-beats; len(ts) < 2 {
		t.Errorf("worker-heartbeats while a command ran for 7 s: at %v", offsets(start, ts))
	}
}
