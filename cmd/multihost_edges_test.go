package cmd

import (
	"strings"
	"testing"
)

// A multi-host database URL whose password holds '@' then '/' (written as
// is): the error naming the database shows the password's tail twice,
// once in describeDB's URL (its "database" is the text after the '/') and
// once in pgx's own message (database=...), which openPool does not pass
// through redactDSN. The flag's own parse errors are redacted; this one,
// the line an operator pastes into a ticket, is not.
func TestMultiHostURLPasswordWithAtAndSlashKeptOut(t *testing.T) {
	t.Parallel()
	const tail = "W0rd-Tail-9c2f"
	dsn := "postgres://app:p@ss/" + tail + "@127.0.0.1:1,127.0.0.1:2/app?target_session_attrs=read-write&connect_timeout=2"
	r := runBin(t, map[string]string{"ONCELER_DATABASE_URL": dsn}, "migrate")
	line := oneLineError(t, r, 1)
	if strings.Contains(line, tail) {
		t.Errorf("the error shows the password's tail %q: %s", tail, line)
	}
}

// A password holding '@' is a URL pgx reads (url.Parse takes the last '@'
// for the end of the user info). When the URL is refused for another flaw
// (a bad sslmode), pgx's own message masks the password only up to its
// first '@', and redactDSN, which replaces the whole password, finds it
// nowhere: the part after the '@' is shown.
func TestMultiHostURLPasswordWithAtKeptOutOfParseError(t *testing.T) {
	t.Parallel()
	const tail = "TailSecret-71b4"
	for _, dsn := range []string{
		"postgres://app:S3cr@" + tail + "@127.0.0.1:1,[::1]:2/app?target_session_attrs=read-write&sslmode=bogus",
		"postgres://app:S3cr@" + tail + "@127.0.0.1:1,127.0.0.1:2/app?target_session_attrs=read-write&sslmode=bogus",
	} {
		r := runBin(t, map[string]string{"ONCELER_DATABASE_URL": dsn}, "migrate")
		if r.code == 0 {
			t.Fatalf("%s: accepted", dsn)
		}
		if strings.Contains(r.stderr, tail) {
			t.Errorf("the error shows the password's part %q: %s", tail, strings.TrimSpace(r.stderr))
		}
	}
}
