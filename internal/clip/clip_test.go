package clip

import "testing"

func TestString(t *testing.T) {
	cases := []struct {
		s    string
		n    int
		want string
	}{
		{"abc", 3, "abc"},
		{"abcd", 3, "abc..."},
		{"", 0, ""},
		{"ab€", 4, "ab..."}, // € is 3 bytes: not cut inside it
		{"ab€", 5, "ab€"},
		{"€€", 1, "..."},
	}
	for _, c := range cases {
		if got := String(c.s, c.n); got != c.want {
			t.Errorf("String(%q, %d) = %q, want %q", c.s, c.n, got, c.want)
		}
	}
	if got := Prefix("ab€", 3); got != "ab" {
		t.Errorf("Prefix = %q", got)
	}
}
