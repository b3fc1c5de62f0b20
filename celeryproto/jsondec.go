package celeryproto

import (
	"encoding/base64"
	"errors"
	"fmt"
	"math"
	"strconv"
	"sync"
	"unicode/utf16"
	"unicode/utf8"
)

// maxDepth bounds nesting so hostile input cannot exhaust the stack.
const maxDepth = 256

// jsonDecoder is a small JSON parser producing the package's value types:
// integers come out as int64 exactly (float64 only past the int64 range),
// other numbers as float64, and kombu >= 5.3 {"__type__", "__value__"}
// envelopes as typed values. It accepts Python's NaN, Infinity and -Infinity.
type jsonDecoder struct {
	data []byte
	// src is data as one string: unescaped strings and keys are substrings
	// of it, so they cost no allocation (they keep the body alive).
	src string
	pos int
	box boxer
	// vals and kvs are stacks shared by nested arrays and objects: elements
	// collect here, then move to a slice or map of the exact size.
	vals []any
	kvs  []kv
	mt   *meter // nil: unmetered
}

type kv struct {
	k string
	v any
}

var errSyntax = errors.New("invalid JSON")

// scratch holds the element stacks between decodes (they are empty and
// cleared when returned).
type scratch struct {
	vals []any
	kvs  []kv
}

func newScratch() any {
	return &scratch{vals: make([]any, 0, 64), kvs: make([]kv, 0, 64)}
}

func decodeJSON(pool *sync.Pool, data []byte, mt *meter) (any, error) {
	// src (strings share it) is a copy of data.
	if err := mt.charge(0, len(data)); err != nil {
		return nil, err
	}
	sc, _ := pool.Get().(*scratch)
	if sc == nil {
		sc = newScratch().(*scratch)
	}
	d := jsonDecoder{data: data, src: string(data), vals: sc.vals[:0], kvs: sc.kvs[:0], mt: mt}
	// A value takes a few bytes at least: a body of a few hundred bytes
	// (Celery's usual) needs small slabs, one of about 1 KiB full ones.
	d.box.first = len(data) / 32
	v, err := d.value(0)
	if err == nil {
		d.skipSpace()
		if d.pos != len(d.data) {
			v, err = nil, d.errorf("trailing data")
		}
	}
	if cap(d.vals) <= 4096 && cap(d.kvs) <= 4096 {
		sc.vals, sc.kvs = d.vals[:0], d.kvs[:0]
		pool.Put(sc)
	}
	return v, err
}

func (d *jsonDecoder) errorf(format string, args ...any) error {
	return fmt.Errorf("%w at offset %d: %s", errSyntax, d.pos, fmt.Sprintf(format, args...))
}

func (d *jsonDecoder) skipSpace() {
	for d.pos < len(d.data) {
		switch d.data[d.pos] {
		case ' ', '\t', '\n', '\r':
			d.pos++
		default:
			return
		}
	}
}

func (d *jsonDecoder) value(depth int) (any, error) {
	if depth > maxDepth {
		return nil, d.errorf("nesting deeper than %d", maxDepth)
	}
	d.skipSpace()
	if d.pos >= len(d.data) {
		return nil, d.errorf("unexpected end of input")
	}
	if err := d.mt.charge(1, 0); err != nil {
		return nil, err
	}
	switch c := d.data[d.pos]; {
	case c == '{':
		return d.object(depth)
	case c == '[':
		return d.array(depth)
	case c == '"':
		s, err := d.str()
		if err != nil {
			return nil, err
		}
		return d.box.str(s), nil
	case c == '-' || (c >= '0' && c <= '9'):
		if d.literal("-Infinity") {
			return math.Inf(-1), nil
		}
		return d.number()
	case d.literal("true"):
		return true, nil
	case d.literal("false"):
		return false, nil
	case d.literal("null"):
		return nil, nil
	case d.literal("NaN"):
		return math.NaN(), nil
	case d.literal("Infinity"):
		return math.Inf(1), nil
	default:
		return nil, d.errorf("unexpected character %q", c)
	}
}

func (d *jsonDecoder) literal(s string) bool {
	if len(d.data)-d.pos >= len(s) && string(d.data[d.pos:d.pos+len(s)]) == s {
		d.pos += len(s)
		return true
	}
	return false
}

func (d *jsonDecoder) array(depth int) (any, error) {
	d.pos++ // [
	d.skipSpace()
	if d.pos < len(d.data) && d.data[d.pos] == ']' {
		d.pos++
		return d.box.slice(nil), nil
	}
	base := len(d.vals)
	defer func() { clear(d.vals[base:]); d.vals = d.vals[:base] }()
	for {
		v, err := d.value(depth + 1)
		if err != nil {
			return nil, err
		}
		d.vals = append(d.vals, v)
		d.skipSpace()
		if d.pos >= len(d.data) {
			return nil, d.errorf("unexpected end of input in array")
		}
		switch d.data[d.pos] {
		case ',':
			d.pos++
		case ']':
			d.pos++
			return d.box.slice(d.vals[base:]), nil
		default:
			return nil, d.errorf("expected , or ] in array")
		}
	}
}

func (d *jsonDecoder) object(depth int) (any, error) {
	d.pos++ // {
	d.skipSpace()
	if d.pos < len(d.data) && d.data[d.pos] == '}' {
		d.pos++
		return map[string]any{}, nil
	}
	base := len(d.kvs)
	defer func() { clear(d.kvs[base:]); d.kvs = d.kvs[:base] }()
	for {
		d.skipSpace()
		if d.pos >= len(d.data) || d.data[d.pos] != '"' {
			return nil, d.errorf("expected string key in object")
		}
		k, err := d.str()
		if err != nil {
			return nil, err
		}
		if err := d.mt.charge(1, 0); err != nil { // the key
			return nil, err
		}
		d.skipSpace()
		if d.pos >= len(d.data) || d.data[d.pos] != ':' {
			return nil, d.errorf("expected : in object")
		}
		d.pos++
		v, err := d.value(depth + 1)
		if err != nil {
			return nil, err
		}
		d.kvs = append(d.kvs, kv{k, v})
		d.skipSpace()
		if d.pos >= len(d.data) {
			return nil, d.errorf("unexpected end of input in object")
		}
		switch d.data[d.pos] {
		case ',':
			d.pos++
		case '}':
			d.pos++
			pairs := d.kvs[base:]
			if err := d.mt.charge(0, mapGroupCost); err != nil {
				return nil, err
			}
			out := make(map[string]any, len(pairs))
			for _, p := range pairs {
				out[p.k] = p.v
			}
			if _, ok := out["__type__"]; ok && len(out) == 2 {
				return unwrapType(out)
			}
			return out, nil
		default:
			return nil, d.errorf("expected , or } in object")
		}
	}
}

// unwrapType turns a kombu >= 5.3 {"__type__": T, "__value__": V} envelope
// into its value.
func unwrapType(o map[string]any) (any, error) {
	t, _ := o["__type__"].(string)
	v, ok := o["__value__"]
	if !ok {
		return o, nil
	}
	s, isStr := v.(string)
	switch t {
	case "datetime", "date":
		if !isStr {
			break
		}
		tm, err := ParseTime(s)
		if err != nil {
			return nil, fmt.Errorf("%w: __type__ %s: %w", errSyntax, t, err)
		}
		return tm, nil
	case "time", "decimal":
		if isStr {
			return s, nil
		}
	case "uuid":
		if isStr {
			return s, nil
		}
		if m, ok := v.(map[string]any); ok {
			if h, ok := m["hex"].(string); ok && len(h) == 32 {
				return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:], nil
			}
		}
	case "bytes":
		if isStr {
			return []byte(s), nil
		}
	case "base64":
		if isStr {
			b, err := base64.StdEncoding.DecodeString(s)
			if err != nil {
				return nil, fmt.Errorf("%w: __type__ base64: %w", errSyntax, err)
			}
			return b, nil
		}
	default:
		return o, nil // not a kombu envelope: an ordinary two-key object
	}
	return nil, fmt.Errorf("%w: __type__ %s with a %T value", errSyntax, t, v)
}

func (d *jsonDecoder) number() (any, error) {
	start := d.pos
	isFloat := false
	if d.data[d.pos] == '-' {
		d.pos++
	}
	for d.pos < len(d.data) {
		c := d.data[d.pos]
		if c >= '0' && c <= '9' {
			d.pos++
			continue
		}
		if c == '.' || c == 'e' || c == 'E' || c == '+' || c == '-' {
			isFloat = true
			d.pos++
			continue
		}
		break
	}
	raw := d.data[start:d.pos]
	if !isFloat {
		if n, ok := parseInt(raw); ok {
			return d.box.int(n), nil
		}
	}
	f, err := strconv.ParseFloat(string(raw), 64)
	if err != nil && !errors.Is(err, strconv.ErrRange) {
		d.pos = start
		return nil, d.errorf("bad number")
	}
	return d.box.float(f), nil
}

// parseInt parses a decimal integer without allocating; ok is false on
// overflow or a malformed number.
func parseInt(b []byte) (int64, bool) {
	neg := false
	if len(b) > 0 && b[0] == '-' {
		neg = true
		b = b[1:]
	}
	if len(b) == 0 || len(b) > 19 || (len(b) > 1 && b[0] == '0') {
		return 0, false
	}
	var n uint64
	for _, c := range b {
		n = n*10 + uint64(c-'0')
	}
	if neg {
		if n > 1<<63 {
			return 0, false
		}
		return -int64(n), true
	}
	if n > math.MaxInt64 {
		return 0, false
	}
	return int64(n), true
}

func (d *jsonDecoder) str() (string, error) {
	d.pos++ // opening quote
	start := d.pos
	for d.pos < len(d.data) {
		c := d.data[d.pos]
		if c == '"' {
			s := d.src[start:d.pos]
			d.pos++
			return s, nil
		}
		if c == '\\' {
			return d.strSlow(start)
		}
		if c < 0x20 {
			return "", d.errorf("control character in string")
		}
		d.pos++
	}
	return "", d.errorf("unterminated string")
}

func (d *jsonDecoder) strSlow(start int) (string, error) {
	buf := make([]byte, 0, d.pos-start+16)
	buf = append(buf, d.data[start:d.pos]...)
	for d.pos < len(d.data) {
		c := d.data[d.pos]
		switch {
		case c == '"':
			d.pos++
			if err := d.mt.charge(0, len(buf)); err != nil {
				return "", err
			}
			return string(buf), nil
		case c < 0x20:
			return "", d.errorf("control character in string")
		case c != '\\':
			buf = append(buf, c)
			d.pos++
			continue
		}
		d.pos++
		if d.pos >= len(d.data) {
			break
		}
		e := d.data[d.pos]
		d.pos++
		switch e {
		case '"', '\\', '/':
			buf = append(buf, e)
		case 'b':
			buf = append(buf, '\b')
		case 'f':
			buf = append(buf, '\f')
		case 'n':
			buf = append(buf, '\n')
		case 'r':
			buf = append(buf, '\r')
		case 't':
			buf = append(buf, '\t')
		case 'u':
			r, ok := d.hex4()
			if !ok {
				return "", d.errorf("bad \\u escape")
			}
			if utf16.IsSurrogate(r) {
				r2 := rune(-1)
				if d.pos+1 < len(d.data) && d.data[d.pos] == '\\' && d.data[d.pos+1] == 'u' {
					save := d.pos
					d.pos += 2
					var ok2 bool
					if r2, ok2 = d.hex4(); !ok2 {
						d.pos = save
						r2 = -1
					}
				}
				if dec := utf16.DecodeRune(r, r2); dec != utf8.RuneError {
					r = dec
				} else {
					r = utf8.RuneError
				}
			}
			buf = utf8.AppendRune(buf, r)
		default:
			return "", d.errorf("bad escape \\%c", e)
		}
	}
	return "", d.errorf("unterminated string")
}

func (d *jsonDecoder) hex4() (rune, bool) {
	if len(d.data)-d.pos < 4 {
		return 0, false
	}
	var r rune
	for _, c := range d.data[d.pos : d.pos+4] {
		switch {
		case c >= '0' && c <= '9':
			r = r<<4 | rune(c-'0')
		case c >= 'a' && c <= 'f':
			r = r<<4 | rune(c-'a'+10)
		case c >= 'A' && c <= 'F':
			r = r<<4 | rune(c-'A'+10)
		default:
			return 0, false
		}
	}
	d.pos += 4
	return r, true
}

// DecodeJSON reads one JSON value the way message bodies are read:
// integers as int64 (float64 beyond its range), other numbers as float64,
// objects as map[string]any, arrays as []any, and kombu ≥ 5.3 "__type__"
// envelopes unwrapped. Strings may share memory with data, which must not
// change afterwards.
func DecodeJSON(data []byte) (any, error) { return decodeJSON(&defaultDecoder.scratch, data, nil) }
