// Package clip cuts text for logs, error messages and tables: at most a
// number of bytes, never inside a UTF-8 sequence.
package clip

import "unicode/utf8"

// Prefix returns the longest prefix of s of at most n bytes that does not
// end inside a UTF-8 sequence: s itself when it is not longer than n.
func Prefix(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

// String returns s when it is at most n bytes, else its Prefix of n bytes
// followed by "..." (which the n bytes do not count).
func String(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return Prefix(s, n) + "..."
}
