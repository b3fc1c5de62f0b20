package tasks

import (
	"fmt"
	"sort"
	"strconv"
	"strings"

	"github.com/onceler/onceler/celeryproto"
)

// reprMax bounds the result repr in task-succeeded events, as Celery's
// resultrepr_maxsize (1024).
const reprMax = 1024

// succeededEvent is task-succeeded: result, the Python repr of the JSON
// result (as Celery's saferepr), and runtime in seconds.
func succeededEvent(res []byte, runtime float64, duplicate bool) *celeryproto.TaskEvent {
	return &celeryproto.TaskEvent{Type: "task-succeeded", Result: resultRepr(res), Runtime: runtime, Duplicate: duplicate}
}

// failedEvent is task-failed (or task-retried): exception, the Python repr of
// the exception, and traceback. A Go task has no Python traceback: a short
// one in Python's shape names the task and the exception.
func failedEvent(typ, task string, exc *celeryproto.Exception) *celeryproto.TaskEvent {
	return &celeryproto.TaskEvent{Type: typ,
		Exception: exc.Type + "(" + pyString(exc.Message) + ")",
		Traceback: "Traceback (most recent call last):\n  onceler Go task " + pyString(task) + "\n" +
			exc.Type + ": " + exc.Message + "\n"}
}

// resultRepr is the Python repr of a JSON result, at most reprMax bytes
// (cut as saferepr does, with "...").
func resultRepr(res []byte) string {
	v, err := jsonValue(res)
	if err != nil {
		return string(res)
	}
	var b strings.Builder
	writeRepr(&b, v)
	s := b.String()
	if len(s) > reprMax {
		s = s[:reprMax-3] + "..."
	}
	return s
}

func writeRepr(b *strings.Builder, v any) {
	if b.Len() > reprMax {
		return
	}
	switch x := v.(type) {
	case nil:
		b.WriteString("None")
	case bool:
		if x {
			b.WriteString("True")
		} else {
			b.WriteString("False")
		}
	case int64:
		b.WriteString(strconv.FormatInt(x, 10))
	case float64:
		s := strconv.FormatFloat(x, 'g', -1, 64)
		if !strings.ContainsAny(s, ".eE") {
			s += ".0"
		}
		b.WriteString(s)
	case string:
		b.WriteString(pyString(x))
	case []any:
		b.WriteByte('[')
		for i, e := range x {
			if i > 0 {
				b.WriteString(", ")
			}
			writeRepr(b, e)
		}
		b.WriteByte(']')
	case map[string]any:
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		b.WriteByte('{')
		for i, k := range keys {
			if i > 0 {
				b.WriteString(", ")
			}
			b.WriteString(pyString(k))
			b.WriteString(": ")
			writeRepr(b, x[k])
		}
		b.WriteByte('}')
	default:
		b.WriteString(pyString(fmt.Sprint(x)))
	}
}

// pyString is a Python str repr: single quotes unless the text holds one
// and no double quote, backslash escapes for quotes, backslashes and control
// characters.
func pyString(s string) string {
	q := byte('\'')
	if strings.IndexByte(s, '\'') >= 0 && strings.IndexByte(s, '"') < 0 {
		q = '"'
	}
	var b strings.Builder
	b.Grow(len(s) + 2)
	b.WriteByte(q)
	for _, r := range s {
		switch {
		case r == rune(q) || r == '\\':
			b.WriteByte('\\')
			b.WriteRune(r)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r == '\t':
			b.WriteString(`\t`)
		case r < 0x20 || r == 0x7f:
			b.WriteString(`\x`)
			b.WriteString(strconv.FormatInt(int64(r)|0x100, 16)[1:])
		default:
			b.WriteRune(r)
		}
	}
	b.WriteByte(q)
	return b.String()
}
