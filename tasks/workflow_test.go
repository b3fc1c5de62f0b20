package tasks

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

type wfFailArgs struct {
	Value any    `celery:"value"`
	Msg   string `celery:"msg"`
}

type wfRecordArgs struct {
	Value any    `celery:"value"`
	Tag   string `celery:"tag"`
}

// callRecorder keeps what t.record was called with.
type callRecorder struct {
	mu   sync.Mutex
	seen []wfRecordArgs
}

func (r *callRecorder) add(a wfRecordArgs) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.seen = append(r.seen, a)
}

func (r *callRecorder) byTag(tag string) []wfRecordArgs {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []wfRecordArgs
	for _, a := range r.seen {
		if a.Tag == tag {
			out = append(out, a)
		}
	}
	return out
}

// workflowRegistry has t.add (pure), t.fail (ValueError(msg)) and t.record
// (keeps its arguments).
func workflowRegistry(t *testing.T, rec *callRecorder) *Registry {
	t.Helper()
	r := NewRegistry()
	for _, err := range []error{
		Register(r, Task[addArgs]{Name: "t.add", Run: func(_ context.Context, _ *Call, a addArgs) (any, error) {
			return a.X + a.Y, nil
		}}),
		Register(r, Task[wfFailArgs]{Name: "t.fail", Run: func(_ context.Context, _ *Call, a wfFailArgs) (any, error) {
			return nil, ValueError(a.Msg)
		}}),
		Register(r, Task[wfRecordArgs]{Name: "t.record", Run: func(_ context.Context, _ *Call, a wfRecordArgs) (any, error) {
			rec.add(a)
			return nil, nil
		}}),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	return r
}

// pythonWorker starts a real Celery worker serving py.mul from testdata/wf.py
// on queue pyq, and kills it at the end of the test.
func (e *env) pythonWorker(pyq string) {
	e.t.Helper()
	py := testenv.Python(e.t)
	cmd := exec.Command(py, "-m", "celery", "-A", "wf", "worker", "-Q", pyq, "--pool", "solo",
		"--without-gossip", "--without-mingle", "--without-heartbeat", "--loglevel", "WARNING", "-n", testenv.Name("py")+"@%h")
	cmd.Dir = "testdata"
	cmd.Env = append(os.Environ(), e.wfEnv(pyq)...)
	cmd.Stdout, cmd.Stderr = testWriter{e.t}, testWriter{e.t}
	if err := cmd.Start(); err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		_, _ = e.ch.QueueDelete(pyq, false, false, false)
		_ = e.ch.ExchangeDelete(pyq, false, false)
	})
	testkit.WaitFor(e.t, "the Python worker to consume", 60*time.Second, func() bool {
		ch, err := e.conn.Channel()
		if err != nil {
			return false
		}
		defer func() { _ = ch.Close() }()
		q, err := ch.QueueDeclarePassive(pyq, true, false, false, false, nil)
		return err == nil && q.Consumers > 0
	})
}

func (e *env) wfEnv(pyq string) []string {
	return []string{"ONCELER_WF_BROKER=" + e.url, "ONCELER_WF_GOQ=" + e.queue, "ONCELER_WF_PYQ=" + pyq,
		"ONCELER_WF_BACKEND=" + e.backend}
}

// testWriter sends a process's output to the test log.
type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Logf("%s", p)
	return len(p), nil
}

// workflows runs wf.py scenarios with real Celery as the caller.
func (e *env) workflows(pyq string, scenarios ...string) map[string]pyResult {
	e.t.Helper()
	py := testenv.Python(e.t)
	ctx, cancel := context.WithTimeout(context.Background(), 180*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, py, filepath.Join("testdata", "wf.py"))
	cmd.Args = append(cmd.Args, scenarios...)
	cmd.Env = append(os.Environ(), e.wfEnv(pyq)...)
	out, err := cmd.Output()
	if err != nil {
		var stderr string
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = string(ee.Stderr)
		}
		e.t.Fatalf("wf.py: %v\n%s", err, stderr)
	}
	var res map[string]pyResult
	if err := json.Unmarshal(out, &res); err != nil {
		e.t.Fatalf("wf.py output %q: %v", out, err)
	}
	return res
}

// TestWorkflowsWithPython: chains, link callbacks, errbacks and groups sent
// by real Celery 5.2.6 over Go tasks, with a Python Celery worker serving a
// step of a mixed chain.
func TestWorkflowsWithPython(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	pyq := testenv.Name("pyq")
	rec := &callRecorder{}
	cfg := e.config()
	cfg.Routes = map[string]string{"py.mul": pyq, "py.kind": pyq}
	e.start(workflowRegistry(t, rec), cfg)
	e.pythonWorker(pyq)
	t.Logf("workflows from %s", pyq)
	res := e.workflows(pyq, "chain_go", "chain_mixed", "chain_msgpack_bytes", "chain_py_first", "chain_group", "chain_group_fail", "chain_bad_args", "link_group", "chain_immutable", "chain_fail", "link", "link_error", "group", "chord")
	for name, r := range res {
		t.Logf("%s: %s %s %s", name, r.OK, r.ExcType, r.Message)
	}
	for name, want := range map[string]string{
		"chain_go":    `113`,
		"chain_mixed": `130`,
		// The step goes on in msgpack, as the chain came: bytes stay bytes.
		"chain_msgpack_bytes": `[3, "bytes", [0, 255]]`,
		"chain_py_first":      `10`,
		"chain_group":         `[13, 23]`,
		"link_group":          `4`,
		"chain_immutable":     `10`,
		"group":               `[2, 4, 9]`,
	} {
		if got := string(res[name].OK); got != want {
			t.Errorf("%s: got %s (%+v), want %s", name, got, res[name], want)
		}
	}
	if r := res["chain_group_fail"]; r.ExcType != "ValueError" || r.Message != "group never runs" {
		t.Errorf("chain with a failing step before a group: %+v, want ValueError('group never runs')", r)
	}
	if r := res["chain_bad_args"]; r.ExcType != "TypeError" {
		t.Errorf("chain with bad arguments in its first step: %+v, want TypeError", r)
	}
	if r := res["chain_fail"]; r.ExcType != "ValueError" || r.Message != "boom" {
		t.Errorf("chain with a failing step: %+v, want ValueError('boom')", r)
	}
	// rpc:// cannot run chords: Celery refuses them in the client already.
	if r := res["chord"]; r.ExcType != "NotImplementedError" {
		t.Errorf("chord: %+v", r)
	}
	var link struct {
		ID     string
		Result int64
	}
	if err := json.Unmarshal(res["link"].OK, &link); err != nil || link.Result != 3 {
		t.Errorf("link: %s %v", res["link"].OK, err)
	}
	var linkErr struct {
		ID      string
		ExcType string `json:"exc_type"`
	}
	if err := json.Unmarshal(res["link_error"].OK, &linkErr); err != nil || linkErr.ExcType != "ValueError" {
		t.Errorf("link_error: %s %v", res["link_error"].OK, err)
	}
	testkit.WaitFor(t, "callbacks and errback", 10*time.Second, func() bool {
		return len(rec.byTag("callback")) > 0 && len(rec.byTag("errback")) > 0 &&
			len(rec.byTag("group-a")) > 0 && len(rec.byTag("group-b")) > 0
	})
	for _, tag := range []string{"group-a", "group-b"} {
		if cb := rec.byTag(tag); len(cb) != 1 || fmt.Sprint(cb[0].Value) != "4" {
			t.Errorf("group link callback %s called with %+v, want (4, %q) once", tag, cb, tag)
		}
	}
	if cb := rec.byTag("callback"); len(cb) != 1 || fmt.Sprint(cb[0].Value) != "3" {
		t.Errorf("link callback called with %+v, want (3, 'callback') once", cb)
	}
	if eb := rec.byTag("errback"); len(eb) != 1 || eb[0].Value != linkErr.ID {
		t.Errorf("errback called with %+v, want (%q, 'errback') once", eb, linkErr.ID)
	}
}

// TestChainStepPublishedOnce: the next chain step of a completed operation
// is published once, however often the step's message is delivered (a
// broker redelivery with the same task id, or a producer's repeat with a new
// one), in outside and same-database mode; the published step carries the
// result, ids and reply_to as Celery would send it.
func TestChainStepPublishedOnce(t *testing.T) {
	t.Parallel()
	for _, task := range []string{"t.pay", "t.credit"} {
		t.Run(task, func(t *testing.T) {
			e := newEnv(t)
			fx := &effects{}
			nextq := testenv.Name("next")
			if _, err := e.ch.QueueDeclare(nextq, true, false, false, false, nil); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _, _ = e.ch.QueueDelete(nextq, false, false, false) })
			reg := testRegistry(t, fx)
			err := Register(reg, Task[payArgs]{Name: "t.credit", Mode: ModeSameDB,
				Key: func(a payArgs) (string, error) { return a.OrderID, nil },
				RunTx: func(ctx context.Context, tx pgx.Tx, c *Call, a payArgs) (any, error) {
					if _, err := tx.Exec(ctx, "SELECT 1"); err != nil {
						return nil, err
					}
					fx.add(c.Key)
					return a.Amount * 2, nil
				}})
			if err != nil {
				t.Fatal(err)
			}
			cfg := e.config()
			cfg.Pool = testenvPool(t)
			w := e.start(reg, cfg)
			replyTo, replies := e.replyQueue()
			step := celeryproto.Signature{Task: "t.next", Args: []any{int64(5)}, Kwargs: map[string]any{},
				Options: map[string]any{"task_id": "next-step-id", "reply_to": "final-reply", "queue": nextq}}
			send := func(id int) *celeryproto.Message {
				m := payMessage(task, id, "chain-op", replyTo)
				m.Chain = []celeryproto.Signature{step}
				e.publish(m)
				return m
			}
			first := send(1)
			got := results(t, replies, 1, 10*time.Second)
			r := got[first.ID]
			if len(r) != 1 || r[0]["status"] != "SUCCESS" {
				t.Fatalf("first delivery: %v", got)
			}
			want, _ := json.Marshal([]any{r[0]["result"], 5})
			send(1) // the same message again
			send(2) // the same operation under a new task id
			got = results(t, replies, 2, 10*time.Second)
			if len(got[taskID(1)]) != 1 || len(got[taskID(2)]) != 1 {
				t.Fatalf("duplicates answered: %v", got)
			}
			if n := fx.snapshot()["chain-op"]; n != 1 {
				t.Errorf("operation ran %d times", n)
			}
			time.Sleep(300 * time.Millisecond)
			var steps []amqp091.Delivery
			for {
				d, ok, err := e.ch.Get(nextq, true)
				if err != nil {
					t.Fatal(err)
				}
				if !ok {
					break
				}
				steps = append(steps, d)
			}
			if len(steps) != 1 {
				t.Fatalf("next step published %d times, want 1", len(steps))
			}
			msg, err := celeryproto.Decode(&celeryproto.Delivery{ContentType: steps[0].ContentType,
				ContentEncoding: steps[0].ContentEncoding, Headers: steps[0].Headers, Body: steps[0].Body,
				CorrelationID: steps[0].CorrelationId, ReplyTo: steps[0].ReplyTo})
			if err != nil {
				t.Fatal(err)
			}
			if msg.Task != "t.next" || msg.ID != "next-step-id" || msg.ReplyTo != "final-reply" || msg.ParentID != first.ID ||
				msg.RootID != first.ID || len(msg.Chain) != 0 {
				t.Errorf("next step %+v", msg)
			}
			if b, _ := json.Marshal(msg.Args); string(b) != string(want) {
				t.Errorf("next step args %s, want %s", b, want)
			}
			if n := counterValue(w.w.m.steps.WithLabelValues("chain")); n != 1 {
				t.Errorf("chain steps published (metric): %v, want 1", n)
			}
			ids, err := e.store.Followups(context.Background(), task, "chain-op")
			if err != nil || !slices.Equal(ids, []string{"next-step-id"}) {
				t.Errorf("recorded followups %v, %v", ids, err)
			}
		})
	}
}

// TestUnsupportedWorkflowRefused: a chord part is refused before it runs:
// FAILURE NotImplementedError to the caller and to the rest of its chain,
// and the message is quarantined.
func TestUnsupportedWorkflowRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := &effects{}
	e.start(testRegistry(t, fx), e.config())
	replyTo, replies := e.replyQueue()
	m := payMessage("t.pay", 1, "chord-op", replyTo)
	m.Chord = &celeryproto.Signature{Task: "t.add", Options: map[string]any{"task_id": "chord-body"}}
	m.Chain = []celeryproto.Signature{{Task: "t.add", Options: map[string]any{"task_id": "after", "reply_to": replyTo}}}
	e.publish(m)
	got := results(t, replies, 2, 10*time.Second)
	for _, id := range []string{m.ID, "after"} {
		r := got[id]
		if len(r) != 1 || r[0]["status"] != "FAILURE" ||
			fmt.Sprint(r[0]["result"].(map[string]any)["exc_type"]) != "NotImplementedError" {
			t.Errorf("result of %s: %v", id, r)
		}
	}
	var q []amqp091.Delivery
	testkit.WaitFor(t, "quarantine", 10*time.Second, func() bool { q = append(q, e.quarantined()...); return len(q) == 1 })
	if q[0].Headers[HeaderReason] != ReasonUnsupported {
		t.Errorf("quarantine headers %v", q[0].Headers)
	}
	if n := fx.snapshot()["chord-op"]; n != 0 {
		t.Errorf("refused task ran %d times", n)
	}
}

func TestUnsupportedWorkflowCases(t *testing.T) {
	t.Parallel()
	plain := celeryproto.Signature{Task: "t.add"}
	group := func(members ...any) celeryproto.Signature {
		return celeryproto.Signature{Task: "celery.group", SubtaskType: "group", Kwargs: map[string]any{"tasks": members}}
	}
	member := map[string]any{"task": "t.add", "args": []any{}, "kwargs": map[string]any{}, "options": map[string]any{}}
	cases := []struct {
		name string
		m    celeryproto.Message
		want string
	}{
		{"plain", celeryproto.Message{Chain: []celeryproto.Signature{plain, plain}, Callbacks: []celeryproto.Signature{plain}}, ""},
		{"group next", celeryproto.Message{Chain: []celeryproto.Signature{group(member, member)}}, ""},
		{"group link", celeryproto.Message{Callbacks: []celeryproto.Signature{group(member)}}, ""},
		{"group later", celeryproto.Message{Chain: []celeryproto.Signature{group(member), plain}}, ""},
		{"group then more", celeryproto.Message{Chain: []celeryproto.Signature{plain, group(member)}}, "chord"},
		{"chord", celeryproto.Message{Chord: &plain}, "chord parts"},
		{"chain step", celeryproto.Message{Chain: []celeryproto.Signature{{Task: "celery.chain", SubtaskType: "chain"}}}, `"chain"`},
		{"nested group", celeryproto.Message{Callbacks: []celeryproto.Signature{group(map[string]any{"task": "celery.group", "subtask_type": "group"})}}, "group member"},
		{"group without tasks", celeryproto.Message{Errbacks: []celeryproto.Signature{{Task: "celery.group", SubtaskType: "group"}}}, "without a list"},
	}
	for _, c := range cases {
		got := unsupportedWorkflow(&c.m)
		if (c.want == "") != (got == "") || !strings.Contains(got, c.want) {
			t.Errorf("%s: %q, want %q", c.name, got, c.want)
		}
	}
}
