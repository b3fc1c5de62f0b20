package cmd

import (
	"bufio"
	"encoding/json"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// stack is a test's own record schema and queue, and the environment that
// points the binary and the Python scripts at them.
type stack struct {
	schema, queue string
	env           map[string]string
}

func newStack(t *testing.T) *stack {
	t.Helper()
	testenv.Python(t)
	pool := testenv.Pool(t)
	s := &stack{schema: testenv.Schema(t, pool), queue: testenv.Name("q")}
	amqpURL := testenv.AMQPURL(t)
	s.env = map[string]string{
		"ONCELER_BROKER_URL":   amqpURL,
		"ONCELER_DATABASE_URL": testenv.DatabaseURL(t),
		"ONCELER_SCHEMA":       s.schema,
		"ONCELER_QUEUES":       s.queue,
		"ONCELER_QUEUE":        s.queue, // quarantine --queue
		"ONCELER_LOG_FORMAT":   "json",
	}
	t.Cleanup(func() { testkit.DeleteQueues(t, amqpURL, s.queue, s.queue+".quarantine") })
	return s
}

// with returns the stack's environment plus extra.
func (s *stack) with(extra map[string]string) map[string]string {
	env := make(map[string]string, len(s.env)+len(extra))
	for k, v := range s.env {
		env[k] = v
	}
	for k, v := range extra {
		env[k] = v
	}
	return env
}

// proc is a started process of the onceler binary or of Python.
type proc struct {
	t      *testing.T
	name   string
	cmd    *exec.Cmd
	stdout testkit.Buffer
	stderr testkit.Buffer
	done   chan struct{}
	err    error
}

func start(t *testing.T, name string, env map[string]string, path string, args ...string) *proc {
	t.Helper()
	p := &proc{t: t, name: name, done: make(chan struct{})}
	p.cmd = exec.Command(path, args...)
	p.cmd.Env = processEnv(env)
	p.cmd.Stdout, p.cmd.Stderr = &p.stdout, &p.stderr
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = p.cmd.Process.Kill()
			<-p.done
		}
		if t.Failed() {
			t.Logf("%s stderr:\n%s", name, p.stderr.String())
		}
	})
	return p
}

// startWorker starts "onceler worker --migrate" and waits until it consumes.
func startWorker(t *testing.T, env map[string]string, args ...string) *proc {
	t.Helper()
	p := start(t, "worker", env, binary, append([]string{"worker", "--migrate"}, args...)...)
	p.waitLog("consuming", 60*time.Second)
	return p
}

// waitLog waits for a log line containing s.
func (p *proc) waitLog(s string, timeout time.Duration) {
	p.t.Helper()
	deadline := time.Now().Add(timeout)
	for !strings.Contains(p.stderr.String(), s) {
		select {
		case <-p.done:
			p.t.Fatalf("%s exited (%v) before logging %q:\n%s", p.name, p.err, s, p.stderr.String())
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("%s did not log %q within %s:\n%s", p.name, s, timeout, p.stderr.String())
		}
	}
}

// wait waits for the process to end and returns its exit error.
func (p *proc) wait(timeout time.Duration) error {
	p.t.Helper()
	select {
	case <-p.done:
		return p.err
	case <-time.After(timeout):
		p.t.Fatalf("%s still running after %s:\n%s", p.name, timeout, p.stderr.String())
		return nil
	}
}

// stop sends SIGTERM and waits for a clean exit.
func (p *proc) stop() {
	p.t.Helper()
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	if err := p.wait(60 * time.Second); err != nil {
		p.t.Fatalf("%s after SIGTERM: %v\n%s", p.name, err, p.stderr.String())
	}
}

// killed reports whether the process died of SIGKILL.
func (p *proc) killed() bool {
	ws, ok := p.cmd.ProcessState.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

// sendPy sends Celery tasks from Python (rpc backend) and prints one JSON
// line per result, in order: {"ok": value} or {"error": type, "message": text}.
const sendPy = `
import json, os, sys
from celery import Celery
queue, timeout, calls = sys.argv[1], float(sys.argv[2]), json.loads(sys.argv[3])
app = Celery("sender", broker=os.environ["ONCELER_BROKER_URL"], backend="rpc://")
sent = [app.send_task(name, args=args, queue=queue) for name, args in calls]
` + printResultsPy

// printResultsPy ends the Python scripts that send calls (sent, their
// results got within timeout): the ids first, then each result or error.
const printResultsPy = `for r in sent:
    print(json.dumps({"id": r.id}), flush=True)
for r in sent:
    try:
        print(json.dumps({"ok": r.get(timeout=timeout)}), flush=True)
    except Exception as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e)}), flush=True)
`

// call is one task sent by sendPy.
type call struct {
	Task string
	Args []any
}

// reply is a result line of sendPy.
type reply struct {
	ID      string `json:"id"`
	OK      any    `json:"ok"`
	Error   string `json:"error"`
	Message string `json:"message"`
}

// sendTasks starts Python sending calls; replies reads its answers.
func (s *stack) sendTasks(t *testing.T, timeout time.Duration, calls ...call) *proc {
	t.Helper()
	list := make([][]any, len(calls))
	for i, c := range calls {
		list[i] = []any{c.Task, c.Args}
	}
	b, _ := json.Marshal(list)
	return start(t, "python sender", s.env, testenv.Python(t), "-c", sendPy, s.queue,
		strconv.FormatFloat(timeout.Seconds(), 'f', -1, 64), string(b))
}

// replies waits for the sender and returns its task ids and results.
func (p *proc) replies(timeout time.Duration) (ids []string, out []reply) {
	p.t.Helper()
	if err := p.wait(timeout); err != nil {
		p.t.Fatalf("python sender: %v\n%s", err, p.stderr.String())
	}
	sc := bufio.NewScanner(strings.NewReader(p.stdout.String()))
	for sc.Scan() {
		var r reply
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			p.t.Fatalf("sender line %q: %v", sc.Text(), err)
		}
		if r.ID != "" {
			ids = append(ids, r.ID)
		} else {
			out = append(out, r)
		}
	}
	return ids, out
}
