package redact

import (
	"strings"
	"testing"
)

// A password holding '@' and then '/' (written as is, not percent-encoded)
// must not be shown in part: URL hides a password holding '/' alone
// ("postgres://app:pw/x,y@[::1]:5432,db2/app" becomes "postgres://…", see
// TestURL), but with an '@' before the '/' url.Parse succeeds, takes the
// text after the first '@' for the host and the rest for the path, and the
// password's tail is printed. URL is what the django-db result backend's
// errors and logs and 'inspect conf' show.
func TestMultiHostPasswordWithAtAndSlash(t *testing.T) {
	for raw, secret := range map[string]string{
		"postgres://app:p@ss/w0rd@[::1]:5432,db2:5433/app?target_session_attrs=read-write": "ss/w0rd",
		"postgres://app:p@ss/w0rd@db1:5432,db2:5433/app?target_session_attrs=read-write":   "ss/w0rd",
		"django-db+postgresql://app:p@ss/w0rd,x@[::1]:5432,[::2]:5433/app":                 "ss/w0rd",
	} {
		got := URL(raw)
		if strings.Contains(got, "w0rd") {
			t.Errorf("URL(%q) = %q: shows the password's tail %q", raw, got, secret)
		}
	}
}
