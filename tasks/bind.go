package tasks

import (
	"encoding/base64"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"time"
	"unicode"

	"github.com/onceler/onceler/internal/intval"
)

// ErrBadArguments is matched (errors.Is) by every argument binding error: a
// missing, unexpected or wrongly typed argument. Such a delivery can never
// succeed and is quarantined.
var ErrBadArguments = errors.New("bad arguments")

// ArgumentError says which argument could not be bound and why.
type ArgumentError struct {
	Task   string // task name, when known
	Arg    string // argument name (kwarg name or field path), or "" for the call as a whole
	Reason string // what was wrong, without the value itself
}

// Error implements error. It never contains argument values, which may be
// secrets.
func (e *ArgumentError) Error() string {
	var b strings.Builder
	b.WriteString("bad arguments")
	if e.Task != "" {
		b.WriteString(" for ")
		b.WriteString(e.Task)
	}
	if e.Arg != "" {
		b.WriteString(": argument ")
		b.WriteString(e.Arg)
	}
	b.WriteString(": ")
	b.WriteString(e.Reason)
	return b.String()
}

// Is reports ErrBadArguments.
func (e *ArgumentError) Is(target error) bool { return target == ErrBadArguments }

// IsBadArguments reports whether err is an argument binding error.
func IsBadArguments(err error) bool { return errors.Is(err, ErrBadArguments) }

type field struct {
	index    int
	name     string
	optional bool
}

type binder struct {
	fields []field
	byName map[string]int // kwarg name -> position in fields
}

func newBinder(t reflect.Type) (*binder, error) {
	if t.Kind() != reflect.Struct {
		return nil, fmt.Errorf("argument type %s is not a struct", t)
	}
	b := &binder{byName: make(map[string]int)}
	for i := range t.NumField() {
		sf := t.Field(i)
		if !sf.IsExported() {
			continue
		}
		var name, opts string
		if tag, ok := sf.Tag.Lookup("celery"); ok {
			name, opts, _ = strings.Cut(tag, ",")
		} else if tag, ok := sf.Tag.Lookup("json"); ok {
			name, opts, _ = strings.Cut(tag, ",")
		} else {
			name = snakeCase(sf.Name)
		}
		if name == "-" {
			continue
		}
		if name == "" {
			name = snakeCase(sf.Name)
		}
		optional := sf.Type.Kind() == reflect.Pointer
		for _, o := range strings.Split(opts, ",") {
			if o == "optional" || o == "omitempty" {
				optional = true
			}
		}
		if _, dup := b.byName[name]; dup {
			return nil, fmt.Errorf("argument type %s: two fields named %q", t, name)
		}
		if err := checkBindable(sf.Type, 0); err != nil {
			return nil, fmt.Errorf("argument type %s field %s: %w", t, sf.Name, err)
		}
		b.byName[name] = len(b.fields)
		b.fields = append(b.fields, field{index: i, name: name, optional: optional})
	}
	return b, nil
}

var (
	timeType  = reflect.TypeFor[time.Time]()
	bytesType = reflect.TypeFor[[]byte]()
)

func checkBindable(t reflect.Type, depth int) error {
	if depth > 16 {
		return nil
	}
	switch t.Kind() {
	case reflect.Chan, reflect.Func, reflect.UnsafePointer, reflect.Complex64, reflect.Complex128, reflect.Uintptr:
		return fmt.Errorf("type %s cannot come from Celery arguments", t)
	case reflect.Pointer, reflect.Slice, reflect.Array:
		return checkBindable(t.Elem(), depth+1)
	case reflect.Map:
		if t.Key().Kind() != reflect.String {
			return fmt.Errorf("map key type %s is not a string kind", t.Key())
		}
		return checkBindable(t.Elem(), depth+1)
	}
	return nil
}

// snakeCase turns CustomerID into customer_id and OrderNo into order_no.
func snakeCase(s string) string {
	r := []rune(s)
	var b strings.Builder
	for i, c := range r {
		if unicode.IsUpper(c) {
			if i > 0 && (unicode.IsLower(r[i-1]) || (i+1 < len(r) && unicode.IsLower(r[i+1]) && unicode.IsUpper(r[i-1]))) {
				b.WriteByte('_')
			}
			b.WriteRune(unicode.ToLower(c))
		} else {
			b.WriteRune(c)
		}
	}
	return b.String()
}

// bind fills dst (a struct value) from Celery positional and keyword
// arguments, as Python would bind them to a function signature.
func (b *binder) bind(dst reflect.Value, args []any, kwargs map[string]any) error {
	if len(args) > len(b.fields) {
		return &ArgumentError{Reason: fmt.Sprintf("takes %d positional arguments but %d were given", len(b.fields), len(args))}
	}
	var set [64]bool
	seen := set[:0]
	if len(b.fields) > len(set) {
		seen = make([]bool, 0, len(b.fields))
	}
	seen = seen[:len(b.fields)]
	for i, v := range args {
		f := b.fields[i]
		if err := convert(dst.Field(f.index), v, f.name); err != nil {
			return err
		}
		seen[i] = true
	}
	for name, v := range kwargs {
		i, ok := b.byName[name]
		if !ok {
			return &ArgumentError{Arg: name, Reason: "unexpected keyword argument"}
		}
		if seen[i] {
			return &ArgumentError{Arg: name, Reason: "got multiple values"}
		}
		f := b.fields[i]
		if err := convert(dst.Field(f.index), v, f.name); err != nil {
			return err
		}
		seen[i] = true
	}
	for i, f := range b.fields {
		if !seen[i] && !f.optional {
			return &ArgumentError{Arg: f.name, Reason: "missing required argument"}
		}
	}
	return nil
}

func mistyped(path string, v any, t reflect.Type) error {
	return &ArgumentError{Arg: path, Reason: fmt.Sprintf("expected %s, got %s", t, pyType(v))}
}

// pyType names a decoded value's kind the way a Python user would know it.
func pyType(v any) string {
	switch v.(type) {
	case nil:
		return "None"
	case bool:
		return "bool"
	case int64, int, int32, int16, int8, uint64, uint32, uint16, uint8, uint:
		return "int"
	case float64, float32:
		return "float"
	case string:
		return "str"
	case []byte:
		return "bytes"
	case []any:
		return "list"
	case map[string]any:
		return "dict"
	case time.Time:
		return "datetime"
	default:
		return fmt.Sprintf("%T", v)
	}
}

// convert assigns the decoded Celery value v to dst, converting between the
// decoder's types (nil, bool, int64, float64, string, []byte, time.Time, []any,
// map[string]any) and the field's Go type. Integers must fit; a float with
// a fractional part never becomes an integer.
func convert(dst reflect.Value, v any, path string) error {
	t := dst.Type()
	if v == nil {
		switch t.Kind() {
		case reflect.Pointer, reflect.Interface, reflect.Slice, reflect.Map:
			dst.SetZero()
			return nil
		}
		return mistyped(path, v, t)
	}
	if t == timeType {
		switch x := v.(type) {
		case time.Time:
			dst.Set(reflect.ValueOf(x))
			return nil
		case string:
			for _, layout := range []string{time.RFC3339Nano, "2006-01-02T15:04:05.999999", "2006-01-02T15:04:05"} {
				if tm, err := time.Parse(layout, x); err == nil {
					dst.Set(reflect.ValueOf(tm))
					return nil
				}
			}
			return &ArgumentError{Arg: path, Reason: "expected an ISO 8601 datetime string"}
		}
		return mistyped(path, v, t)
	}
	switch t.Kind() {
	case reflect.Interface:
		if t.NumMethod() != 0 {
			return mistyped(path, v, t)
		}
		dst.Set(reflect.ValueOf(v))
		return nil
	case reflect.Pointer:
		p := reflect.New(t.Elem())
		if err := convert(p.Elem(), v, path); err != nil {
			return err
		}
		dst.Set(p)
		return nil
	case reflect.Bool:
		if x, ok := v.(bool); ok {
			dst.SetBool(x)
			return nil
		}
	case reflect.String:
		if x, ok := v.(string); ok {
			dst.SetString(x)
			return nil
		}
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		n, ok := asInt(v)
		if !ok {
			return mistyped(path, v, t)
		}
		if dst.OverflowInt(n) {
			return &ArgumentError{Arg: path, Reason: fmt.Sprintf("integer out of range for %s", t)}
		}
		dst.SetInt(n)
		return nil
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		n, ok := asInt(v)
		if !ok {
			if u, isU := v.(uint64); isU && !dst.OverflowUint(u) {
				dst.SetUint(u)
				return nil
			}
			return mistyped(path, v, t)
		}
		if n < 0 || dst.OverflowUint(uint64(n)) {
			return &ArgumentError{Arg: path, Reason: fmt.Sprintf("integer out of range for %s", t)}
		}
		dst.SetUint(uint64(n))
		return nil
	case reflect.Float32, reflect.Float64:
		switch x := v.(type) {
		case float64:
			dst.SetFloat(x)
			return nil
		case float32:
			dst.SetFloat(float64(x))
			return nil
		}
		if n, ok := asInt(v); ok {
			dst.SetFloat(float64(n))
			return nil
		}
	case reflect.Slice:
		if t == bytesType {
			switch x := v.(type) {
			case []byte:
				dst.SetBytes(append([]byte(nil), x...))
				return nil
			case string:
				b, err := base64.StdEncoding.DecodeString(x)
				if err != nil {
					return &ArgumentError{Arg: path, Reason: "expected bytes or a base64 string"}
				}
				dst.SetBytes(b)
				return nil
			}
		}
		list, ok := v.([]any)
		if !ok {
			return mistyped(path, v, t)
		}
		s := reflect.MakeSlice(t, len(list), len(list))
		for i, e := range list {
			if err := convert(s.Index(i), e, fmt.Sprintf("%s[%d]", path, i)); err != nil {
				return err
			}
		}
		dst.Set(s)
		return nil
	case reflect.Array:
		list, ok := v.([]any)
		if !ok {
			return mistyped(path, v, t)
		}
		if len(list) != t.Len() {
			return &ArgumentError{Arg: path, Reason: fmt.Sprintf("expected %d elements, got %d", t.Len(), len(list))}
		}
		for i, e := range list {
			if err := convert(dst.Index(i), e, fmt.Sprintf("%s[%d]", path, i)); err != nil {
				return err
			}
		}
		return nil
	case reflect.Map:
		m, ok := v.(map[string]any)
		if !ok {
			return mistyped(path, v, t)
		}
		out := reflect.MakeMapWithSize(t, len(m))
		for k, e := range m {
			ev := reflect.New(t.Elem()).Elem()
			if err := convert(ev, e, path+"."+k); err != nil {
				return err
			}
			out.SetMapIndex(reflect.ValueOf(k).Convert(t.Key()), ev)
		}
		dst.Set(out)
		return nil
	case reflect.Struct:
		m, ok := v.(map[string]any)
		if !ok {
			return mistyped(path, v, t)
		}
		b, err := newBinder(t)
		if err != nil {
			return &ArgumentError{Arg: path, Reason: err.Error()}
		}
		if err := b.bind(dst, nil, m); err != nil {
			var ae *ArgumentError
			if errors.As(err, &ae) {
				ae.Arg = path + "." + ae.Arg
			}
			return err
		}
		return nil
	}
	return mistyped(path, v, t)
}

// asInt reads an integer argument: any integer width (intval.Int), or a
// whole float64 within int64's range (JSON numbers written as 3.0).
func asInt(v any) (int64, bool) {
	if x, ok := v.(float64); ok {
		if x == math.Trunc(x) && x >= math.MinInt64 && x < math.MaxInt64 {
			return int64(x), true
		}
		return 0, false
	}
	return intval.Int(v)
}
