package tasks

// Tracebacks of Go task failures in the text shape of Python's (what Celery
// puts in a FAILURE result and in task-failed): the frames of the task
// function, most recent call last, after the worker's call of it (named by
// the task), and the error chain before them. Only function
// names, files and lines: never argument values.

import (
	"errors"
	"fmt"
	"reflect"
	"runtime"
	"strings"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/clip"
)

// maxTraceFrames and maxTraceChain bound a traceback: frames kept (the most
// recent), error chain layers shown.
const (
	maxTraceFrames = 64
	maxTraceChain  = 8
)

// WithStack returns err carrying the stack of its caller: a failing task
// that returns it gets the frames from the task function to where WithStack
// was called in its traceback (the result's and task-failed's), rather than
// the task function's frame alone. Errors that carry a stack of their own
// (a StackTrace method returning program counters, as github.com/pkg/errors
// has, or a Callers() []uintptr method) are read the same way. WithStack(nil)
// is nil.
func WithStack(err error) error {
	if err == nil {
		return nil
	}
	pcs := make([]uintptr, maxTraceFrames)
	n := runtime.Callers(2, pcs)
	return &stackError{err: err, pcs: pcs[:n]}
}

type stackError struct {
	err error
	pcs []uintptr
}

func (e *stackError) Error() string      { return e.err.Error() }
func (e *stackError) Unwrap() error      { return e.err }
func (e *stackError) Callers() []uintptr { return e.pcs }

// panicPCs is the stack of a panicking goroutine, read in the deferred
// function that recovers it.
func panicPCs() []uintptr {
	pcs := make([]uintptr, 128)
	n := runtime.Callers(2, pcs)
	pcs = pcs[:n]
	// From the frame that panicked: skip the deferred function and the
	// runtime's panic frames.
	frames := runtime.CallersFrames(pcs)
	for i := 0; ; i++ {
		f, more := frames.Next()
		if f.Function == "runtime.gopanic" {
			return pcs[i+1:]
		}
		if !more {
			return pcs
		}
	}
}

// traceFrame is one frame of a traceback.
type traceFrame struct {
	function, file string
	line           int
}

// tasksPkg is the prefix of this package's function names.
var tasksPkg = reflect.TypeOf(stackError{}).PkgPath() + "."

// protectName is the function name of protect: a task's frames end there.
var protectName = runtime.FuncForPC(reflect.ValueOf(protect).Pointer()).Name()

// taskFrames turns program counters (most recent first) into the task's
// frames, outermost first: those below protect and the worker's own
// wrappers around the task function are left out, and so are the runtime's
// frames at the top.
func taskFrames(pcs []uintptr) []traceFrame {
	var out []traceFrame
	frames := runtime.CallersFrames(pcs)
	for {
		f, more := frames.Next()
		if f.Function == protectName {
			break
		}
		if f.Function != "" && !(len(out) == 0 && strings.HasPrefix(f.Function, "runtime.")) {
			out = append(out, traceFrame{f.Function, f.File, f.Line})
		}
		if !more {
			break
		}
	}
	// The worker's closures between protect and the task function.
	for len(out) > 0 && wrapperFrame(out[len(out)-1]) {
		out = out[:len(out)-1]
	}
	if len(out) > maxTraceFrames {
		out = out[:maxTraceFrames]
	}
	for i, k := 0, len(out)-1; i < k; i, k = i+1, k-1 {
		out[i], out[k] = out[k], out[i]
	}
	return out
}

// wrapperFrame reports whether f is one of the worker's own functions
// around a task function (not a test's task in this package).
func wrapperFrame(f traceFrame) bool {
	return strings.HasPrefix(f.function, tasksPkg) && !strings.HasSuffix(f.file, "_test.go")
}

// funcFrame is the frame of a function value's declaration (nil: none).
func funcFrame(pc uintptr) []traceFrame {
	fn := runtime.FuncForPC(pc)
	if fn == nil {
		return nil
	}
	file, line := fn.FileLine(fn.Entry())
	return []traceFrame{{fn.Name(), file, line}}
}

// stackOf returns the program counters an error in err's chain carries.
// A method of the user's error that panics (a nil receiver, say) costs the
// traceback its frames, never the worker.
func stackOf(err error) (pcs []uintptr) {
	defer func() {
		if recover() != nil {
			pcs = nil
		}
	}()
	for e := err; e != nil; e = errors.Unwrap(e) {
		if c, ok := e.(interface{ Callers() []uintptr }); ok {
			return c.Callers()
		}
		if pcs := reflectStackTrace(e); pcs != nil {
			return pcs
		}
	}
	return nil
}

// errorText is e.Error(), or ok false when that panics (a nil receiver
// stored in an error value, say).
func errorText(e error) (s string, ok bool) {
	defer func() {
		if recover() != nil {
			s, ok = "", false
		}
	}()
	return e.Error(), true
}

// reflectStackTrace reads a StackTrace method returning a slice of program
// counters of a named type (github.com/pkg/errors' StackTrace).
func reflectStackTrace(e error) []uintptr {
	m := reflect.ValueOf(e).MethodByName("StackTrace")
	if !m.IsValid() || m.Type().NumIn() != 0 || m.Type().NumOut() != 1 {
		return nil
	}
	t := m.Type().Out(0)
	if t.Kind() != reflect.Slice || t.Elem().Kind() != reflect.Uintptr {
		return nil
	}
	v := m.Call(nil)[0]
	pcs := make([]uintptr, v.Len())
	for i := range pcs {
		pcs[i] = uintptr(v.Index(i).Uint())
	}
	return pcs
}

// taskTraceback is the traceback of a task's failure err, answered as exc:
// for a panic, the frames from the task function to the panic; for a
// returned error, those its chain carries (WithStack), else the task
// function's frame; then the errors the returned one wraps, innermost
// first, each the direct cause of the next, as Python prints a chain (a
// cause's message only where the returned error's own text shows it).
func (j *job) taskTraceback(exc *celeryproto.Exception, err error) string {
	var frames []traceFrame
	var pe *PanicError
	chained := true
	switch {
	case errors.As(err, &pe) && pe.pcs != nil:
		frames, chained = taskFrames(pe.pcs), false
	case stackOf(err) != nil:
		frames = taskFrames(stackOf(err))
	}
	if len(frames) == 0 && j.h != nil {
		frames = funcFrame(j.h.fnPC)
	}
	var b strings.Builder
	if chained {
		var causes []error
		for e := errors.Unwrap(err); e != nil && len(causes) < maxTraceChain; e = errors.Unwrap(e) {
			if _, ok := e.(*stackError); ok {
				continue
			}
			causes = append(causes, e)
		}
		// A cause's message is shown only where the returned error showed
		// it: an error that keeps a cause for errors.Is but hides its text
		// (a card number, a gateway's answer) keeps it hidden here too.
		shown, _ := errorText(err)
		shown += "\n" + exc.Message
		for i := len(causes) - 1; i >= 0; i-- {
			msg, ok := errorText(causes[i])
			if pe, isPy := causes[i].(*PythonError); isPy {
				msg, ok = pe.Message, true
			}
			line := goErrorType(causes[i])
			if ok && msg != "" && strings.Contains(shown, msg) {
				line += ": " + clip.String(msg, maxLogField)
			}
			b.WriteString(line + "\n")
			b.WriteString("\nThe above exception was the direct cause of the following exception:\n\n")
		}
	}
	b.WriteString("Traceback (most recent call last):\n")
	if j.h != nil {
		// The worker's call of the task function, named by the task.
		if call := funcFrame(j.h.callPC); call != nil {
			fmt.Fprintf(&b, "  File %q, line %d, in <task %s>\n", call[0].file, call[0].line, celeryproto.StringRepr(j.h.name))
		}
	}
	for _, f := range frames {
		fmt.Fprintf(&b, "  File %q, line %d, in %s\n", f.file, f.line, f.function)
	}
	b.WriteString(exc.Type + ": " + exc.Message + "\n")
	return b.String()
}

// goErrorType names an error's Go type as Python names an exception's class
// outside builtins: package.Type; a PythonError by its Python class.
func goErrorType(e error) string {
	if pe, ok := e.(*PythonError); ok {
		if pe.Module == "" || pe.Module == "builtins" {
			return pe.Type
		}
		return pe.Module + "." + pe.Type
	}
	return strings.TrimLeft(fmt.Sprintf("%T", e), "*")
}
