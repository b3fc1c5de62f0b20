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
