package tasks

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

type xsumArgs struct {
	Numbers []float64 `celery:"numbers"`
}

type gateArgs struct {
	Token string `celery:"token"`
}

// gate makes the calls with the same token return together: each waits
// until two have arrived (or 10 s).
type gate struct {
	mu      sync.Mutex
	arrived map[string]chan struct{}
	count   map[string]int
}

func (g *gate) wait(ctx context.Context, token string) {
	g.mu.Lock()
	if g.arrived == nil {
		g.arrived, g.count = map[string]chan struct{}{}, map[string]int{}
	}
	ch, ok := g.arrived[token]
	if !ok {
		ch = make(chan struct{})
		g.arrived[token] = ch
	}
	g.count[token]++
	if g.count[token] == 2 {
		close(ch)
	}
	g.mu.Unlock()
	select {
	case <-ch:
	case <-ctx.Done():
	case <-time.After(10 * time.Second):
	}
}

// chordRegistry is workflowRegistry with t.xsum (the sum of a list) and
// t.gate (returns its token once its partner has arrived).
func chordRegistry(t *testing.T, rec *callRecorder, g *gate) *Registry {
	t.Helper()
	reg := workflowRegistry(t, rec)
	for _, err := range []error{
		Register(reg, Task[xsumArgs]{Name: "t.xsum", Run: func(_ context.Context, _ *Call, a xsumArgs) (any, error) {
			var sum float64
			for _, n := range a.Numbers {
				sum += n
			}
			return int64(sum), nil
		}}),
		Register(reg, Task[gateArgs]{Name: "t.gate", Run: func(ctx context.Context, _ *Call, a gateArgs) (any, error) {
			g.wait(ctx, a.Token)
			return a.Token, nil
		}}),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	return reg
}

// TestChordsWithRedis: chords sent by real Celery 5.2.6 with the Redis
// result backend, their header parts run by a onceler worker: the worker
// that ends the header publishes the body with the results in header
// order, to a Go body (t.xsum) or to a Python body run by a real Celery
// worker on another queue (py.xsum), and chord.get() has its result; the
// body goes out in the serializer the parts came in (msgpack: bytes stay
// bytes); a
// failed part gives the body's result ChordError (chord.get() raises the
// part's error first, as in Celery) and its
// errback is called with the body's task id; the chord counters are gone
// once the body is out.
func TestChordsWithRedis(t *testing.T) {
	addr := testkit.RedisAddr(t)
	e := newEnv(t)
	e.backend = fmt.Sprintf("redis://%s/%d", addr, redisTestDB)
	pyq := testenv.Name("pyq")
	rec := &callRecorder{}
	cfg := e.config()
	cfg.Routes = map[string]string{"py.mul": pyq, "py.kind": pyq, "py.xsum": pyq}
	cfg.ResultBackend = e.backend
	e.start(chordRegistry(t, rec, &gate{}), cfg)
	e.pythonWorker(pyq)
	res := e.workflows(pyq, "chord_go_body", "chord_py_body", "chord_msgpack", "chord_fail")
	for name, want := range map[string]string{"chord_go_body": `30`, "chord_py_body": `12`, "chord_msgpack": `[[2], "bytes", [0, 255]]`} {
		if got := string(res[name].OK); got != want {
			t.Errorf("%s: got %s (%+v), want %s", name, got, res[name], want)
		}
	}
	var failed struct {
		ID          string
		HeaderError string `json:"header_exc_type"`
		ExcType     string `json:"exc_type"`
		ExcModule   string `json:"exc_module"`
		Message     string
	}
	if err := json.Unmarshal(res["chord_fail"].OK, &failed); err != nil {
		t.Fatalf("chord_fail: %+v: %v", res["chord_fail"], err)
	}
	// AsyncResult.get() raises the failed part's ValueError when the part
	// failed before get() looked at the chord's parents, else the body's
	// ChordError once the body fails: Celery's client races there.
	if (failed.HeaderError != "ValueError" && failed.HeaderError != "ChordError") || failed.ExcType != "ChordError" || failed.ExcModule != "celery.exceptions" ||
		!strings.HasPrefix(failed.Message, "Dependency ") || !strings.HasSuffix(failed.Message, " raised ValueError('part boom')") {
		t.Errorf("chord_fail: %+v, want celery.exceptions.ChordError Dependency <id> raised ValueError('part boom')", failed)
	}
	testkit.WaitFor(t, "the chord body's errback", 10*time.Second, func() bool { return len(rec.byTag("chord-errback")) > 0 })
	if got := rec.byTag("chord-errback"); len(got) != 1 || got[0].Value != failed.ID {
		t.Errorf("chord errback calls %+v, want one with the body's id %s", got, failed.ID)
	}
	c := redisClient(t, addr, redisTestDB)
	keys, err := c.Keys(context.Background(), GroupKeyPrefix+"*.[jtsf]").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		if ttl := c.TTL(context.Background(), k).Val(); ttl < 0 {
			t.Errorf("chord counter %s left without expiry", k)
		}
	}
}

// TestChordPartsFinishTogether: five chords of two header parts each, the
// parts held until their partner runs on the other of two onceler workers,
// so that both finish at the same moment: each chord body is published
// once, with both results.
func TestChordPartsFinishTogether(t *testing.T) {
	addr := testkit.RedisAddr(t)
	e := newEnv(t)
	e.backend = fmt.Sprintf("redis://%s/%d", addr, redisTestDB)
	rec := &callRecorder{}
	g := &gate{}
	reg := chordRegistry(t, rec, g)
	for range 2 {
		cfg := e.config()
		cfg.ResultBackend = e.backend
		cfg.Concurrency, cfg.Prefetch = 1, 1
		e.start(reg, cfg)
	}
	res := e.workflows("unused", "chord_gate")
	var ids []string
	if err := json.Unmarshal(res["chord_gate"].OK, &ids); err != nil || len(ids) != 5 {
		t.Fatalf("chord_gate: %+v %v", res["chord_gate"], err)
	}
	time.Sleep(500 * time.Millisecond) // a second body would run by now
	bodies := rec.byTag("chord-gate")
	if len(bodies) != 5 {
		t.Fatalf("bodies ran %d times for 5 chords: %+v", len(bodies), bodies)
	}
	seen := map[string]bool{}
	for _, b := range bodies {
		l, _ := b.Value.([]any)
		if len(l) != 2 || l[0] != l[1] {
			t.Errorf("body got %v, want both parts' tokens", b.Value)
			continue
		}
		tok := fmt.Sprint(l[0])
		if seen[tok] {
			t.Errorf("body of chord %s ran twice", tok)
		}
		seen[tok] = true
	}
	if len(seen) != 5 || slices.Contains(ids, "") {
		t.Errorf("bodies for %v, chord ids %v", seen, ids)
	}
}

// TestChordPartEntry: a part's join entry is Celery's [1, task_id, state,
// result], read back the same way; a failure quotes the exception as
// Python's repr.
func TestChordPartEntry(t *testing.T) {
	b, err := celeryproto.EncodeChordPart(&celeryproto.Result{TaskID: "a", Status: celeryproto.StateFailure,
		Exception: &celeryproto.Exception{Type: "ValueError", Message: "it's bad"}})
	if err != nil {
		t.Fatal(err)
	}
	if want := `[1, "a", "FAILURE", {"exc_message": ["it's bad"], "exc_module": "builtins", "exc_type": "ValueError"}]`; string(b) != want {
		t.Errorf("entry %s, want %s", b, want)
	}
	p, err := celeryproto.DecodeChordPart("json", b)
	if err != nil || !p.Propagates() || p.ExceptionRepr() != `ValueError("it's bad")` {
		t.Errorf("decoded %+v %v, repr %s", p, err, p.ExceptionRepr())
	}
}

// TestRedisChordFinisher: of a chord's parts, the one that completes the
// header publishes the body; its redelivery (it died before the body went
// out) publishes it again, a redelivery of another part never does, and
// once the chord is done nothing does.
func TestRedisChordFinisher(t *testing.T) {
	addr := testkit.RedisAddr(t)
	b, err := newRedisBackend(fmt.Sprintf("redis://%s/%d", addr, redisTestDB), &Config{ResultExpires: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = b.close() }()
	ctx := context.Background()
	gid := testenv.Name("chord")
	if err := b.c.Set(ctx, GroupKeyPrefix+gid+".s", 2, time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	part := func(id string, index int, want bool) {
		t.Helper()
		entry := fmt.Appendf(nil, `[1, %q, "SUCCESS", %d]`, id, index)
		fire, joined, err := b.chordPart(ctx, gid, id, &index, entry)
		if err != nil || fire != want {
			t.Fatalf("part %s: fire %v, %v; want %v", id, fire, err, want)
		}
		if fire && (len(joined) != 2 || !strings.Contains(string(joined[0]), `"a"`)) {
			t.Fatalf("joined %q, want a's entry first", joined)
		}
	}
	part("b", 1, false) // the second part finishes first
	part("a", 0, true)  // completes the header
	part("b", 1, false) // a redelivery of the other part
	part("a", 0, true)  // the finisher's redelivery, before the chord is done
	if err := b.chordDone(ctx, gid); err != nil {
		t.Fatal(err)
	}
	part("a", 0, false) // after it
}
