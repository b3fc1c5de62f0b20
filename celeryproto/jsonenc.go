package celeryproto

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"math"
	"reflect"
	"slices"
	"strconv"
	"time"
	"unicode/utf8"
)

// appendJSONValue writes v as JSON the way Python's json module reads it:
// keys sorted (so the output is canonical), integral floats with ".0" so they
// stay floats, NaN/Infinity as Python writes them, time.Time as FormatTime,
// []byte as a kombu >= 5.3 base64 envelope, json.RawMessage as the JSON it
// holds (empty: null).
func appendJSONValue(b []byte, v any, depth int) ([]byte, error) {
	if depth > maxDepth {
		return nil, fmt.Errorf("value nested deeper than %d", maxDepth)
	}
	switch x := v.(type) {
	case nil:
		return append(b, "null"...), nil
	case bool:
		return strconv.AppendBool(b, x), nil
	case string:
		return appendJSONString(b, x), nil
	case int64:
		return strconv.AppendInt(b, x, 10), nil
	case int:
		return strconv.AppendInt(b, int64(x), 10), nil
	case int32:
		return strconv.AppendInt(b, int64(x), 10), nil
	case int16:
		return strconv.AppendInt(b, int64(x), 10), nil
	case int8:
		return strconv.AppendInt(b, int64(x), 10), nil
	case uint64:
		return strconv.AppendUint(b, x, 10), nil
	case uint:
		return strconv.AppendUint(b, uint64(x), 10), nil
	case uint32:
		return strconv.AppendUint(b, uint64(x), 10), nil
	case uint16:
		return strconv.AppendUint(b, uint64(x), 10), nil
	case uint8:
		return strconv.AppendUint(b, uint64(x), 10), nil
	case float64:
		return appendJSONFloat(b, x), nil
	case float32:
		return appendJSONFloat(b, float64(x)), nil
	case time.Time:
		b = append(b, '"')
		b = appendTime(b, x)
		return append(b, '"'), nil
	case json.RawMessage:
		// Already JSON (e.g. a stored result): written as it is, compacted.
		if len(x) == 0 {
			return append(b, "null"...), nil
		}
		var buf bytes.Buffer
		if err := json.Compact(&buf, x); err != nil {
			return nil, fmt.Errorf("raw JSON value: %w", err)
		}
		return append(b, buf.Bytes()...), nil
	case []byte:
		b = append(b, `{"__type__": "base64", "__value__": "`...)
		b = base64.StdEncoding.AppendEncode(b, x)
		return append(b, `"}`...), nil
	case []any:
		b = append(b, '[')
		for i, e := range x {
			if i > 0 {
				b = append(b, ", "...)
			}
			var err error
			if b, err = appendJSONValue(b, e, depth+1); err != nil {
				return nil, err
			}
		}
		return append(b, ']'), nil
	case []string:
		b = append(b, '[')
		for i, e := range x {
			if i > 0 {
				b = append(b, ", "...)
			}
			b = appendJSONString(b, e)
		}
		return append(b, ']'), nil
	case map[string]any:
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		b = append(b, '{')
		for i, k := range keys {
			if i > 0 {
				b = append(b, ", "...)
			}
			b = appendJSONString(b, k)
			b = append(b, ": "...)
			var err error
			if b, err = appendJSONValue(b, x[k], depth+1); err != nil {
				return nil, err
			}
		}
		return append(b, '}'), nil
	case Signature:
		return appendJSONValue(b, x.wire(), depth)
	case *Signature:
		if x == nil {
			return append(b, "null"...), nil
		}
		return appendJSONValue(b, x.wire(), depth)
	}
	return appendJSONReflect(b, v, depth)
}

// appendJSONReflect handles other slices and string-keyed maps (e.g.
// []int, map[string]string) that callers put in results.
func appendJSONReflect(b []byte, v any, depth int) ([]byte, error) {
	rv := reflect.ValueOf(v)
	switch rv.Kind() {
	case reflect.Slice, reflect.Array:
		list := make([]any, rv.Len())
		for i := range list {
			list[i] = rv.Index(i).Interface()
		}
		return appendJSONValue(b, list, depth)
	case reflect.Map:
		if rv.Type().Key().Kind() != reflect.String {
			break
		}
		m := make(map[string]any, rv.Len())
		for it := rv.MapRange(); it.Next(); {
			m[it.Key().String()] = it.Value().Interface()
		}
		return appendJSONValue(b, m, depth)
	case reflect.Pointer:
		if rv.IsNil() {
			return append(b, "null"...), nil
		}
		return appendJSONValue(b, rv.Elem().Interface(), depth)
	case reflect.String:
		return appendJSONString(b, rv.String()), nil
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return strconv.AppendInt(b, rv.Int(), 10), nil
	case reflect.Float32, reflect.Float64:
		return appendJSONFloat(b, rv.Float()), nil
	case reflect.Bool:
		return strconv.AppendBool(b, rv.Bool()), nil
	}
	return nil, fmt.Errorf("cannot encode a %T as JSON", v)
}

func appendJSONFloat(b []byte, f float64) []byte {
	switch {
	case math.IsNaN(f):
		return append(b, "NaN"...)
	case math.IsInf(f, 1):
		return append(b, "Infinity"...)
	case math.IsInf(f, -1):
		return append(b, "-Infinity"...)
	}
	if f == math.Trunc(f) && math.Abs(f) < 1e16 {
		b = strconv.AppendFloat(b, f, 'f', -1, 64)
		return append(b, ".0"...)
	}
	return strconv.AppendFloat(b, f, 'g', -1, 64)
}

const hexDigits = "0123456789abcdef"

// appendJSONString writes s as an ASCII-only JSON string, as Python's
// json.dumps does by default; invalid UTF-8 becomes U+FFFD.
func appendJSONString(b []byte, s string) []byte {
	b = append(b, '"')
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			switch {
			case c == '"' || c == '\\':
				b = append(b, '\\', c)
			case c == '\n':
				b = append(b, '\\', 'n')
			case c == '\r':
				b = append(b, '\\', 'r')
			case c == '\t':
				b = append(b, '\\', 't')
			case c < 0x20 || c == 0x7f:
				b = append(b, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
			default:
				b = append(b, c)
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		i += size
		if r >= 0x10000 {
			r1, r2 := utf16Pair(r)
			b = appendU(b, r1)
			b = appendU(b, r2)
			continue
		}
		b = appendU(b, r)
	}
	return append(b, '"')
}

func utf16Pair(r rune) (rune, rune) {
	r -= 0x10000
	return 0xd800 + (r>>10)&0x3ff, 0xdc00 + r&0x3ff
}

func appendU(b []byte, r rune) []byte {
	return append(b, '\\', 'u', hexDigits[r>>12&0xf], hexDigits[r>>8&0xf], hexDigits[r>>4&0xf], hexDigits[r&0xf])
}
