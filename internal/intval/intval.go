// Package intval reads an integer from a decoded value (an AMQP table's,
// a JSON or msgpack document's), whatever width or signedness the decoder
// chose for it.
package intval

import "math"

// Int returns v as an int64 when it is an integer of any width; an
// unsigned one only when it fits.
func Int(v any) (int64, bool) {
	switch x := v.(type) {
	case int:
		return int64(x), true
	case int8:
		return int64(x), true
	case int16:
		return int64(x), true
	case int32:
		return int64(x), true
	case int64:
		return x, true
	case uint8:
		return int64(x), true
	case uint16:
		return int64(x), true
	case uint32:
		return int64(x), true
	case uint:
		if uint64(x) <= math.MaxInt64 {
			return int64(x), true
		}
	case uint64:
		if x <= math.MaxInt64 {
			return int64(x), true
		}
	}
	return 0, false
}

// Whole is Int that also takes a float holding a whole number exactly (1.0
// from JSON, a Python float): a float64 under 2^53, a float32 under 2^24
// in magnitude, where every integer has a float of its own.
func Whole(v any) (int64, bool) {
	switch x := v.(type) {
	case float64:
		if x == math.Trunc(x) && math.Abs(x) < 1<<53 {
			return int64(x), true
		}
		return 0, false
	case float32:
		if f := float64(x); f == math.Trunc(f) && math.Abs(f) < 1<<24 {
			return int64(x), true
		}
		return 0, false
	}
	return Int(v)
}
