package tasks

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/onceler/onceler/celeryproto"
)

// Adversarial edges of taskTraceback (traceback.go): user error types in
// the chain of a returned error.

type tbEdgeArgs struct {
	Card string `celery:"card"`
}

func tbEdgeRun(context.Context, *Call, tbEdgeArgs) (any, error) { return nil, nil }

// tbEdgeJob is a job bound to a registered task, as finish sees it.
func tbEdgeJob(t *testing.T) *job {
	t.Helper()
	reg := NewRegistry()
	if err := Register(reg, Task[tbEdgeArgs]{Name: "t.tb_edge", Run: tbEdgeRun}); err != nil {
		t.Fatal(err)
	}
	h, ok := reg.get("t.tb_edge")
	if !ok {
		t.Fatal("not registered")
	}
	return &job{h: h}
}

// publicError is a common Go pattern: a message safe to show (Error) with
// the internal cause kept for errors.Is/As (Unwrap) but not shown.
type publicError struct {
	msg   string
	cause error
}

func (e *publicError) Error() string { return e.msg }
func (e *publicError) Unwrap() error { return e.cause }

// gatewayError's Error reads its receiver: a nil *gatewayError in an error
// interface (the classic typed-nil) panics when its Error is called.
type gatewayError struct{ code int }

func (e *gatewayError) Error() string { return fmt.Sprintf("gateway status %d", e.code) }

// tracebackOf calls taskTraceback as finish does, reporting a panic.
func tracebackOf(j *job, err error) (tb string, panicked any) {
	defer func() { panicked = recover() }()
	exc := exceptionFor(err)
	return j.taskTraceback(exc, err), nil
}

// TestTracebackCauseWithPanickingError: a returned error whose own Error
// is fine but whose wrapped cause's Error panics (a typed-nil pointer in the
// chain). Before tracebacks, the answer stage only called the outer Error
// (exceptionFor; zap recovers a panic in Error); now taskTraceback calls
// every cause's Error on the task goroutine, outside protect's recover, so
// the panic ends the worker process (every running task cut, the delivery
// redelivered and crashing the next worker alike). Expected: the traceback
// is built without panicking (the cause shown as unprintable, or left out).
func TestTracebackCauseWithPanickingError(t *testing.T) {
	j := tbEdgeJob(t)
	var gw *gatewayError // nil: the gateway call did not get a response
	err := &publicError{msg: "payment failed", cause: gw}
	if got := exceptionFor(err).Message; got != "payment failed" {
		t.Fatalf("exception message %q", got)
	}
	if _, p := tracebackOf(j, err); p != nil {
		t.Errorf("taskTraceback panicked (the worker process would die in finish): %v", p)
	}
}

// stackTracer has a StackTrace method of program counters (read by
// reflection, as for github.com/pkg/errors) that panics on a nil receiver.
type stackTracer struct{ pcs []uintptr }

type tbPCs []uintptr

func (e *stackTracer) Error() string     { return "traced" }
func (e *stackTracer) StackTrace() tbPCs { return tbPCs(e.pcs) }

// TestTracebackStackTraceMethodPanics: a StackTrace method called by
// reflection on a typed-nil cause panics inside taskTraceback (stackOf),
// again on the task goroutine outside any recover.
func TestTracebackStackTraceMethodPanics(t *testing.T) {
	j := tbEdgeJob(t)
	var st *stackTracer
	err := &publicError{msg: "payment failed", cause: st}
	if _, p := tracebackOf(j, err); p != nil {
		t.Errorf("taskTraceback panicked (the worker process would die in finish): %v", p)
	}
}

// TestTracebackShowsRedactedCause: a task returns an error whose message
// is safe ("card declined") and keeps the gateway's error, which names the
// card number, as its Unwrap cause only. The exception (result and
// task-failed) says "card declined"; the traceback, sent in the same result
// and broadcast in task-failed, prints the cause's message, card number
// included. Expected: the traceback adds no text the task's error did not
// show (no argument value, no secret).
func TestTracebackShowsRedactedCause(t *testing.T) {
	j := tbEdgeJob(t)
	card := "4111111111111111"
	err := &publicError{msg: "card declined", cause: fmt.Errorf("gateway refused card %s", card)}
	if got := exceptionFor(err).Message; strings.Contains(got, card) {
		t.Fatalf("exception message %q already has the card", got)
	}
	tb, p := tracebackOf(j, err)
	if p != nil {
		t.Fatal(p)
	}
	if strings.Contains(tb, card) {
		t.Errorf("traceback shows the card number the error hid:\n%s", tb)
	}
	if !errors.Is(err, err.cause) {
		t.Fatal("cause not in chain")
	}
}

// TestTracebackCausePanicEndsWorker is TestTracebackCauseWithPanickingError
// through a running worker: a pure task returns an error whose wrapped
// cause is a nil *gatewayError. Run in a child process (the panic ends the
// process that runs the worker). Expected: the caller gets FAILURE
// "payment failed" and the worker runs on; observed: the worker process
// dies in finish with the cause's nil dereference, the caller is never
// answered and the delivery goes back to the queue (to crash the next
// worker too).
func TestTracebackCausePanicEndsWorker(t *testing.T) {
	if os.Getenv("ONCELER_TB_EDGE_CHILD") == "1" {
		tbEdgeWorkerChild(t)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestTracebackCausePanicEndsWorker$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), "ONCELER_TB_EDGE_CHILD=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		text := string(out)
		if i := strings.Index(text, "panic:"); i >= 0 {
			text = text[i:min(len(text), i+1500)]
		} else {
			text = text[max(0, len(text)-1500):]
		}
		t.Errorf("worker process with a task returning an error whose cause's Error panics: %v\n%s", err, text)
	}
}

func tbEdgeWorkerChild(t *testing.T) {
	e := newEnv(t)
	reg := NewRegistry()
	err := Register(reg, Task[tbEdgeArgs]{Name: "t.tb_edge_gw", Run: func(context.Context, *Call, tbEdgeArgs) (any, error) {
		var gw *gatewayError
		return nil, &publicError{msg: "payment failed", cause: gw}
	}})
	if err != nil {
		t.Fatal(err)
	}
	e.start(reg, e.config())
	replyTo, replies := e.replyQueue()
	e.publish(&celeryproto.Message{Protocol: 2, Task: "t.tb_edge_gw", ID: taskID(1), Kwargs: map[string]any{"card": "x"},
		ReplyTo: replyTo, CorrelationID: taskID(1), RootID: taskID(1)})
	res := collect(replies, 1, 20*time.Second)
	rs := res[taskID(1)]
	if len(rs) == 0 || rs[0]["status"] != "FAILURE" {
		t.Fatalf("result %v", rs)
	}
}

// A task that returns an error whose Error method panics gets an error the
// worker can answer and log, naming the type.
func TestProtectReturnedErrorThatPanics(t *testing.T) {
	_, err := protect(context.Background(), &Call{}, func(context.Context, *Call) (any, error) {
		var gw *gatewayError
		return nil, gw
	})
	if err == nil || !strings.Contains(err.Error(), "*tasks.gatewayError") {
		t.Fatalf("protect: %v", err)
	}
	if exc := exceptionFor(err); exc.Type != "Exception" || !strings.Contains(exc.Message, "Error method panicked") {
		t.Errorf("exception %+v", exc)
	}
}
