// Package shellquote quotes words for a POSIX shell, so that a command a
// message prints can be pasted as is.
package shellquote

import "strings"

// safe reports whether every byte of s stands for itself in a shell word.
func safe(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		case strings.IndexByte("_-.,:/@%+=", c) >= 0:
		default:
			return false
		}
	}
	return s != ""
}

// Quote returns s as one shell word: s itself when it needs no quoting,
// else s in single quotes (a single quote in s closes them, is written
// escaped with a backslash, and opens them again).
func Quote(s string) string {
	if safe(s) {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
