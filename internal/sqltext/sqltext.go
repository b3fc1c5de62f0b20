// Package sqltext reads just enough of PostgreSQL's SQL text to find where a
// statement's first word begins: white space and comments, as PostgreSQL's
// lexer skips them.
package sqltext

import "strings"

// SkipBlanks returns s after the characters of cutset and the comments
// before its first word: line comments ("--" to a line feed or a carriage
// return, both of which end one for PostgreSQL) and block comments, which
// nest. ok is false when a comment runs to the end of s.
func SkipBlanks(s, cutset string) (rest string, ok bool) {
	for {
		s = strings.TrimLeft(s, cutset)
		switch {
		case strings.HasPrefix(s, "--"):
			i := strings.IndexAny(s, "\n\r")
			if i < 0 {
				return "", false
			}
			s = s[i+1:]
		case strings.HasPrefix(s, "/*"):
			end := BlockCommentEnd(s)
			if end < 0 {
				return "", false
			}
			s = s[end:]
		default:
			return s, true
		}
	}
}

// BlockCommentEnd returns the index just past the block comment s begins
// with, nested ones included, or -1 when it does not end.
func BlockCommentEnd(s string) int {
	depth := 0
	for i := 0; i+1 < len(s); i++ {
		switch {
		case s[i] == '/' && s[i+1] == '*':
			depth++
			i++
		case s[i] == '*' && s[i+1] == '/':
			depth--
			i++
			if depth == 0 {
				return i + 1
			}
		}
	}
	return -1
}
