package amqp

import (
	"fmt"
	"reflect"
	"time"

	amqp091 "github.com/onceler/onceler/internal/amqp091"
)

// fromTable converts received headers in place to plain Go values: nested
// tables become map[string]any, unsigned integers int64, decimals strings.
// The table belongs to one delivery, so reusing its map costs no copy; flat
// headers of strings and signed integers are not touched at all.
func fromTable(t amqp091.Table) map[string]any {
	if t == nil {
		return nil
	}
	m := map[string]any(t)
	for k, v := range m {
		if nv, changed := fromField(v); changed {
			m[k] = nv
		}
	}
	return m
}

// fromField converts one received value; changed is false when v is
// already a plain value.
func fromField(v any) (any, bool) {
	switch x := v.(type) {
	case nil, string, bool, int8, int16, int32, int64, float32, float64, []byte, time.Time:
		return v, false
	case amqp091.Table:
		return fromTable(x), true
	case []any:
		for i, e := range x {
			if ne, changed := fromField(e); changed {
				x[i] = ne
			}
		}
		return v, false // converted in place; re-boxing x would allocate
	case uint8:
		return int64(x), true
	case uint16:
		return int64(x), true
	case uint32:
		return int64(x), true
	case int:
		return int64(x), true
	case amqp091.Decimal:
		return decimalString(x), true
	}
	return v, false
}

func decimalString(d amqp091.Decimal) string {
	if d.Scale == 0 {
		return fmt.Sprint(d.Value)
	}
	neg := d.Value < 0
	v := int64(d.Value)
	if neg {
		v = -v
	}
	s := fmt.Sprint(v)
	for len(s) <= int(d.Scale) {
		s = "0" + s
	}
	s = s[:len(s)-int(d.Scale)] + "." + s[len(s)-int(d.Scale):]
	if neg {
		s = "-" + s
	}
	return s
}

// toTable converts headers to publish. The map is used as it is when it
// holds only values AMQP encodes directly; otherwise a converted copy is
// made, so the caller's map is never changed.
func toTable(m map[string]any) (amqp091.Table, error) {
	if m == nil {
		return nil, nil
	}
	plain := true
	for _, v := range m {
		if !plainField(v) {
			plain = false
			break
		}
	}
	if plain {
		return amqp091.Table(m), nil
	}
	t := make(amqp091.Table, len(m))
	for k, v := range m {
		nv, err := toField(v)
		if err != nil {
			return nil, fmt.Errorf("header %q: %w", k, err)
		}
		t[k] = nv
	}
	return t, nil
}

func plainField(v any) bool {
	switch x := v.(type) {
	case nil, string, bool, int8, int16, int32, int64, int, uint8, uint16, uint32,
		float32, float64, []byte, time.Time:
		return true
	case []any:
		for _, e := range x {
			if !plainField(e) {
				return false
			}
		}
		return true
	}
	return false
}

// toField converts one value to a type amqp091 encodes.
func toField(v any) (any, error) {
	switch x := v.(type) {
	case nil, string, bool, int8, int16, int32, int64, int, uint8, uint16, uint32,
		float32, float64, []byte, time.Time, amqp091.Decimal:
		return v, nil
	case uint:
		return toInt64(uint64(x))
	case uint64:
		return toInt64(x)
	case map[string]any:
		return toTable(x)
	case amqp091.Table:
		return toTable(map[string]any(x))
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			ne, err := toField(e)
			if err != nil {
				return nil, fmt.Errorf("item %d: %w", i, err)
			}
			out[i] = ne
		}
		return out, nil
	case []string:
		out := make([]any, len(x))
		for i, e := range x {
			out[i] = e
		}
		return out, nil
	}
	rv := reflect.ValueOf(v)
	switch rv.Kind() {
	case reflect.Slice, reflect.Array:
		out := make([]any, rv.Len())
		for i := range out {
			ne, err := toField(rv.Index(i).Interface())
			if err != nil {
				return nil, fmt.Errorf("item %d: %w", i, err)
			}
			out[i] = ne
		}
		return out, nil
	case reflect.Map:
		if rv.Type().Key().Kind() != reflect.String {
			break
		}
		t := make(amqp091.Table, rv.Len())
		it := rv.MapRange()
		for it.Next() {
			ne, err := toField(it.Value().Interface())
			if err != nil {
				return nil, fmt.Errorf("key %q: %w", it.Key().String(), err)
			}
			t[it.Key().String()] = ne
		}
		return t, nil
	case reflect.String:
		return rv.String(), nil
	}
	return nil, fmt.Errorf("type %T cannot be an AMQP header value", v)
}

func toInt64(u uint64) (any, error) {
	if u > 1<<63-1 {
		return nil, fmt.Errorf("integer %d overflows an AMQP long", u)
	}
	return int64(u), nil
}
