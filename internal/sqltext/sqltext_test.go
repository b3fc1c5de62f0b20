package sqltext

import "testing"

func TestSkipBlanks(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		in, rest string
		ok       bool
	}{
		{"  SELECT 1", "SELECT 1", true},
		{"-- a\nSELECT", "SELECT", true},
		{"-- a\rCOMMIT /*\nSELECT */", "COMMIT /*\nSELECT */", true},
		{"/* a /* b */ c */ DELETE", "DELETE", true},
		{"/* a /* b */ COMMIT", "", false},
		{"-- only", "", false},
		{"\f\t\r\n", "", true},
	} {
		rest, ok := SkipBlanks(c.in, " \t\r\n\f")
		if rest != c.rest || ok != c.ok {
			t.Errorf("SkipBlanks(%q) = %q, %v; want %q, %v", c.in, rest, ok, c.rest, c.ok)
		}
	}
}
