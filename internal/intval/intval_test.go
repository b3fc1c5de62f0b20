package intval

import (
	"math"
	"testing"
)

func TestIntAndWhole(t *testing.T) {
	cases := []struct {
		v          any
		int, whole bool
		want       int64
	}{
		{int(-3), true, true, -3},
		{int8(-8), true, true, -8},
		{int16(300), true, true, 300},
		{int32(-70000), true, true, -70000},
		{int64(math.MinInt64), true, true, math.MinInt64},
		{uint8(255), true, true, 255},
		{uint16(65535), true, true, 65535},
		{uint32(math.MaxUint32), true, true, math.MaxUint32},
		{uint(7), true, true, 7},
		{uint64(math.MaxInt64), true, true, math.MaxInt64},
		{uint64(math.MaxInt64 + 1), false, false, 0},
		{float64(2), false, true, 2},
		{float64(-2), false, true, -2},
		{2.5, false, false, 0},
		{float64(1 << 53), false, false, 0},
		{math.NaN(), false, false, 0},
		{math.Inf(1), false, false, 0},
		{float32(4), false, true, 4},
		{float32(1 << 24), false, false, 0},
		{"3", false, false, 0},
		{nil, false, false, 0},
		{true, false, false, 0},
	}
	for _, c := range cases {
		if n, ok := Int(c.v); ok != c.int || (ok && n != c.want) {
			t.Errorf("Int(%T %v) = %d, %v; want %d, %v", c.v, c.v, n, ok, c.want, c.int)
		}
		if n, ok := Whole(c.v); ok != c.whole || (ok && n != c.want) {
			t.Errorf("Whole(%T %v) = %d, %v; want %d, %v", c.v, c.v, n, ok, c.want, c.whole)
		}
	}
}
