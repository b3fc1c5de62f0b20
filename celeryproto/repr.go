package celeryproto

import (
	"fmt"
	"sort"
	"strconv"
	"strings"

	"github.com/onceler/onceler/internal/clip"
)

// reprMax bounds a repr as Celery's saferepr does for argsrepr, kwargsrepr
// and the result of task-succeeded events (resultrepr_maxsize, 1024).
const reprMax = 1024

// Repr returns Python's repr of a decoded value (nil, bools, numbers,
// strings, lists and string-keyed maps, as the decoders give them; other
// Go integers and floats too), cut to 1024 bytes with "..." as Celery's
// saferepr cuts argsrepr, kwargsrepr and event results. Map keys are
// sorted. What it does not know it writes as a str of its Go formatting.
func Repr(v any) string {
	var b strings.Builder
	writeRepr(&b, v)
	return cutRepr(b.String())
}

// ArgsRepr returns Python's repr of the positional arguments as a tuple
// ("(1, 'a')", "(1,)", "()"), cut as Repr: a message's argsrepr.
func ArgsRepr(args []any) string {
	var b strings.Builder
	b.WriteByte('(')
	for i, a := range args {
		if i > 0 {
			b.WriteString(", ")
		}
		writeRepr(&b, a)
	}
	if len(args) == 1 {
		b.WriteByte(',')
	}
	b.WriteByte(')')
	return cutRepr(b.String())
}

// StringRepr returns Python's repr of a str: single quotes, unless the text
// holds a single quote and no double quote; backslash escapes for the
// quote, backslashes and control characters. It is not cut.
func StringRepr(s string) string {
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

// cutRepr cuts a repr longer than reprMax to reprMax bytes, "..." included.
func cutRepr(s string) string {
	if len(s) <= reprMax {
		return s
	}
	return clip.Prefix(s, reprMax-3) + "..."
}

// writeRepr writes v's repr; it stops descending once b is past reprMax
// (the rest would be cut).
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
	case int:
		b.WriteString(strconv.Itoa(x))
	case int32:
		b.WriteString(strconv.FormatInt(int64(x), 10))
	case uint64:
		b.WriteString(strconv.FormatUint(x, 10))
	case float64:
		writeFloat(b, x, 64)
	case float32:
		writeFloat(b, float64(x), 32)
	case string:
		b.WriteString(StringRepr(x))
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
			b.WriteString(StringRepr(k))
			b.WriteString(": ")
			writeRepr(b, x[k])
		}
		b.WriteByte('}')
	default:
		b.WriteString(StringRepr(fmt.Sprint(x)))
	}
}

// writeFloat writes a float as Python does: always with a point or an
// exponent.
func writeFloat(b *strings.Builder, f float64, bits int) {
	s := strconv.FormatFloat(f, 'g', -1, bits)
	if !strings.ContainsAny(s, ".eE") {
		s += ".0"
	}
	b.WriteString(s)
}
