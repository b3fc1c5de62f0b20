package tasks

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"regexp"
	"runtime"
	"strings"
	"testing"
)

type tbArgs struct {
	N int64 `celery:"n"`
}

// tbPanic is a task that panics two calls deep.
func tbPanic(_ context.Context, _ *Call, a tbArgs) (any, error) {
	return tbPanicDeep(a.N), nil
}

func tbPanicDeep(n int64) int64 {
	if n > 0 {
		panic(fmt.Sprintf("boom %d", n))
	}
	return n
}

// tbWrapped returns a wrapped error without a stack.
func tbWrapped(_ context.Context, _ *Call, a tbArgs) (any, error) {
	return nil, fmt.Errorf("charge order: %w", &PythonError{Type: "ValueError", Module: "builtins", Message: "boom"})
}

// tbStacked returns a wrapped error with the stack of where it was made.
func tbStacked(_ context.Context, _ *Call, a tbArgs) (any, error) {
	return nil, tbStackedInner(a.N)
}

func tbStackedInner(int64) error {
	return fmt.Errorf("gateway: %w", WithStack(errors.New("connection refused")))
}

// funcLine is the file and first line of fn.
func funcLine(fn any) (string, string, int) {
	f := runtime.FuncForPC(reflectPointer(fn))
	file, line := f.FileLine(f.Entry())
	return f.Name(), file, line
}

// TestTracebackOfGoFailures: a panic and returned (wrapped) errors give,
// in the result read by Python's AsyncResult.traceback and in task-failed,
// a traceback in Python's shape with the Go frames of the task function
// (name, file and line), the error chain, and no argument values.
func TestTracebackOfGoFailures(t *testing.T) {
	e := newEnv(t)
	rec := &recorder{}
	cfg := e.config()
	cfg.Observer = rec
	reg := NewRegistry()
	for name, fn := range map[string]func(context.Context, *Call, tbArgs) (any, error){
		"t.tb_panic": tbPanic, "t.tb_wrapped": tbWrapped, "t.tb_stacked": tbStacked} {
		if err := Register(reg, Task[tbArgs]{Name: name, Run: fn}); err != nil {
			t.Fatal(err)
		}
	}
	e.start(reg, cfg)
	res := e.python(2, "json",
		pyCall{Task: "t.tb_panic", Kwargs: map[string]any{"n": 424242}},
		pyCall{Task: "t.tb_wrapped", Kwargs: map[string]any{"n": 424243}},
		pyCall{Task: "t.tb_stacked", Kwargs: map[string]any{"n": 424244}},
	)
	events := map[string]string{}
	rec.mu.Lock()
	for _, ev := range rec.events {
		if ev["type"] == "task-failed" {
			events[fmt.Sprint(ev["uuid"])], _ = ev["traceback"].(string)
		}
	}
	rec.mu.Unlock()
	frame := func(fn any, body bool) *regexp.Regexp {
		name, file, line := funcLine(fn)
		l := regexp.QuoteMeta(fmt.Sprint(line))
		if body {
			l = `\d+` // a line inside the function
		}
		return regexp.MustCompile(`\n  File "` + regexp.QuoteMeta(file) + `", line ` + l + `, in ` + regexp.QuoteMeta(name) + `\n`)
	}
	for i, c := range []struct {
		task   string
		frames []*regexp.Regexp // in this order
		chain  []string
		last   string
	}{
		{"t.tb_panic", []*regexp.Regexp{frame(tbPanic, true), frame(tbPanicDeep, true)}, nil,
			"Exception: task panicked: boom 424242\n"},
		{"t.tb_wrapped", []*regexp.Regexp{frame(tbWrapped, false)},
			[]string{"ValueError: boom\n\nThe above exception was the direct cause of the following exception:\n\nTraceback (most recent call last):\n"},
			"ValueError: boom\n"},
		{"t.tb_stacked", []*regexp.Regexp{frame(tbStacked, true), frame(tbStackedInner, true)},
			[]string{"errors.errorString: connection refused\n\nThe above exception was the direct cause of the following exception:\n\nTraceback (most recent call last):\n"},
			"Exception: gateway: connection refused\n"},
	} {
		r := res[i]
		for where, tb := range map[string]string{"result": r.Traceback, "task-failed": events[r.ID]} {
			ok := strings.Contains(tb, "Traceback (most recent call last):\n  File ") && strings.HasSuffix(tb, c.last) &&
				strings.Contains(tb, "in <task '"+c.task+"'>\n")
			at := 0
			for _, re := range c.frames {
				loc := re.FindStringIndex(tb[at:])
				if loc == nil {
					ok = false
					break
				}
				at += loc[1] - 1
			}
			for _, s := range c.chain {
				ok = ok && strings.HasPrefix(tb, s)
			}
			if strings.Contains(tb, "42424") && !strings.Contains(c.last, "42424") || strings.Contains(tb, "0x") {
				ok = false // an argument value
			}
			if !ok {
				t.Errorf("%s: %s traceback:\n%s", c.task, where, tb)
			}
		}
	}
}

func reflectPointer(fn any) uintptr { return reflect.ValueOf(fn).Pointer() }
