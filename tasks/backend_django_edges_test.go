package tasks

import (
	"strings"
	"testing"
)

// A django-db result backend URL whose password holds '@' (a URL pgx
// reads: url.Parse takes the last '@'), refused for another flaw: pgx's
// message masks the password only up to its first '@', and
// newDjangoBackend's own replacement of the whole password finds nothing
// to replace (with an IPv6 host in the list it does not even try, as
// url.Parse refuses the URL). The part after the '@' is shown.
func TestDjangoMultiHostPasswordWithAtKeptOut(t *testing.T) {
	const tail = "TailSecret-3e9a"
	for _, raw := range []string{
		"django-db+postgresql://app:S3cr@" + tail + "@db1:5432,db2:5433/app?target_session_attrs=read-write&sslmode=bogus",
		"django-db+postgresql://app:S3cr@" + tail + "@[::1]:5432,[::2]:5433/app?target_session_attrs=read-write&sslmode=bogus",
	} {
		_, err := newDjangoBackend(raw, &Config{})
		if err == nil {
			t.Fatalf("%s: accepted", raw)
		}
		if strings.Contains(err.Error(), tail) {
			t.Errorf("the error shows the password's part %q: %v", tail, err)
		}
	}
}
