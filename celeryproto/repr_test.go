package celeryproto

import (
	"strings"
	"testing"
)

func TestRepr(t *testing.T) {
	t.Parallel()
	cases := []struct {
		v     any
		tuple bool
		want  string
	}{
		{[]any{int64(3), "x"}, true, "(3, 'x')"},
		{[]any{int64(3)}, true, "(3,)"},
		{[]any{}, true, "()"},
		{map[string]any{"b": nil, "a": []any{true, 2.5, "it's"}}, false, `{'a': [True, 2.5, "it's"], 'b': None}`},
		{map[string]any{}, false, "{}"},
		{[]any{1250, float32(0.5), uint64(7)}, true, "(1250, 0.5, 7)"},
	}
	for _, c := range cases {
		got := Repr(c.v)
		if c.tuple {
			got = ArgsRepr(c.v.([]any))
		}
		if got != c.want {
			t.Errorf("repr(%v) = %s, want %s", c.v, got, c.want)
		}
	}
	long := ArgsRepr([]any{strings.Repeat("x", 5000)})
	if len(long) != 1024 || !strings.HasSuffix(long, "...") {
		t.Errorf("long repr: %d chars", len(long))
	}
	if got := StringRepr("a'\"\\\x01"); got != `'a\'"\\\x01'` {
		t.Errorf("StringRepr = %s", got)
	}
}
