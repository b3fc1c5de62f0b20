package idempotency

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgconn"
)

// The limits of what a record keeps. The record's primary key (task, key)
// lives in a B-tree index, whose entries PostgreSQL caps at about 2.7 kB: a
// longer key would make every claim of the operation fail. Claims beyond
// these limits are refused with ErrTooLong, before anything is sent.
const (
	// MaxKeyBytes is the longest operation key, in bytes.
	MaxKeyBytes = 1024
	// MaxTaskBytes is the longest task name, in bytes.
	MaxTaskBytes = 256
)

// ErrTooLong reports a task name or operation key beyond MaxTaskBytes or
// MaxKeyBytes. It is definite: the same claim is refused every time.
var ErrTooLong = errors.New("idempotency: task name or operation key too long for the record")

// StorableText returns s as PostgreSQL keeps it in a text column: invalid
// UTF-8 becomes U+FFFD and NUL (which text cannot hold) the six characters
// \u0000. Text that needs neither is returned unchanged.
func StorableText(s string) string {
	if utf8.ValidString(s) && !strings.ContainsRune(s, 0) {
		return s
	}
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", `\u0000`)
}

// StorableJSON returns the JSON document b as jsonb keeps it, or
// ErrInvalidResult when b is not JSON. Inside strings, an escaped NUL
// (\u0000, which jsonb refuses) and an unpaired surrogate escape (\ud800)
// become the escape's text (the string holds a backslash, then u0000), and
// bytes that are not UTF-8 become U+FFFD, as Go's encoder writes them. A
// document that needs none of this is returned unchanged. Numbers are not
// rewritten: one beyond PostgreSQL's numeric range makes the write fail
// with a definite error (see IsDefinite).
func StorableJSON(b []byte) ([]byte, error) {
	if !json.Valid(b) {
		return nil, ErrInvalidResult
	}
	if utf8.Valid(b) && !bytes.Contains(b, []byte(`\u`)) {
		return b, nil
	}
	var out []byte // nil until the first change
	keep := 0      // b[keep:] has not been copied to out yet
	change := func(at, end int, with string) {
		if out == nil {
			out = make([]byte, 0, len(b)+16)
		}
		out = append(out, b[keep:at]...)
		out = append(out, with...)
		keep = end
	}
	inString := false
	for i := 0; i < len(b); {
		c := b[i]
		switch {
		case !inString:
			if c == '"' {
				inString = true
			}
			i++
		case c == '"':
			inString = false
			i++
		case c == '\\':
			if b[i+1] != 'u' {
				i += 2
				continue
			}
			r := hex4(b[i+2 : i+6])
			switch {
			case r == 0:
				change(i, i+6, `\\u0000`)
				i += 6
			case r >= 0xD800 && r <= 0xDBFF:
				// A high surrogate must be followed by a low one.
				if i+12 <= len(b) && b[i+6] == '\\' && b[i+7] == 'u' {
					if lo := hex4(b[i+8 : i+12]); lo >= 0xDC00 && lo <= 0xDFFF {
						i += 12
						continue
					}
				}
				change(i, i+6, `\\`+string(b[i+1:i+6]))
				i += 6
			case r >= 0xDC00 && r <= 0xDFFF:
				change(i, i+6, `\\`+string(b[i+1:i+6]))
				i += 6
			default:
				i += 6
			}
		case c < utf8.RuneSelf:
			i++
		default:
			r, n := utf8.DecodeRune(b[i:])
			if r == utf8.RuneError && n == 1 {
				change(i, i+1, `\ufffd`)
			}
			i += n
		}
	}
	if out == nil {
		return b, nil
	}
	return append(out, b[keep:]...), nil
}

// hex4 reads four hexadecimal digits (valid JSON guarantees them).
func hex4(h []byte) rune {
	var r rune
	for _, c := range h {
		r <<= 4
		switch {
		case c >= '0' && c <= '9':
			r |= rune(c - '0')
		case c >= 'a' && c <= 'f':
			r |= rune(c - 'a' + 10)
		case c >= 'A' && c <= 'F':
			r |= rune(c - 'A' + 10)
		}
	}
	return r
}

// IsDefinite reports whether err is the database's refusal of what was
// written, the same every time it is tried: a value it cannot store (data
// exceptions, SQLSTATE class 22; a program limit, 54), a constraint
// (integrity, 23; check option, 44), a statement run in a transaction that
// already failed (25P02), an exception raised by a trigger or function
// (P0), or a cardinality violation (21); also ErrTooLong and
// ErrInvalidResult. Trying it again cannot help: the write's content must
// change. Everything else (a lost connection, a timeout, a server shutting
// down, a missing table, a lack of privilege) may pass and is not definite.
func IsDefinite(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, ErrTooLong) || errors.Is(err, ErrInvalidResult) {
		return true
	}
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Severity == "FATAL" || pgErr.Severity == "PANIC" {
		return false
	}
	code := pgErr.SQLState()
	if code == "25P02" {
		return true
	}
	if len(code) < 2 {
		return false
	}
	switch code[:2] {
	case "21", "22", "23", "44", "54", "P0":
		return true
	}
	return false
}

// refusedCommit reports whether err is the server's refusal of a COMMIT
// for what the transaction wrote (a deferred constraint, a constraint
// trigger raising any SQLSTATE): an answer, not a lost connection, and not
// one of the transient refusals (serialization failure, deadlock, a server
// shutting down) that the same transaction may pass when run again.
func refusedCommit(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Severity == "FATAL" || pgErr.Severity == "PANIC" {
		return false
	}
	return !IsRetryable(err)
}

// TaskTxError is the failure of a same-database task's transaction caused
// by the task's own work, not by the record or the connection: a statement
// of the task failed and the task returned without an error (the
// transaction is aborted), the task ended the transaction itself, or the
// commit was refused for the task's data (a deferred constraint). Nothing
// of the transaction committed; the task fails like any task error.
type TaskTxError struct {
	// What says what happened, in words.
	What string
	// Err is the database's error, if any.
	Err error
}

// Error implements error.
func (e *TaskTxError) Error() string {
	if e.Err == nil {
		return "run tx: " + e.What
	}
	return fmt.Sprintf("run tx: %s: %v", e.What, e.Err)
}

// Unwrap returns the database's error.
func (e *TaskTxError) Unwrap() error { return e.Err }
