package redact

import (
	"strings"
	"testing"
)

func TestURL(t *testing.T) {
	t.Parallel()
	for raw, want := range map[string]string{
		"redis://:s3cret@cache:6379/0":                         "redis://:****@cache:6379/0",
		"rediss://user:s3cret@cache/1?ssl_cert_reqs=none":      "rediss://user:****@cache/1?ssl_cert_reqs=none",
		"redis://cache:6379/0?password=s3cret":                 "redis://cache:6379/0?password=****",
		"django-db+postgresql://app:pw@db/app?sslmode=require": "django-db+postgresql://app:****@db/app?sslmode=require",
		"redis://cache:6379/0":                                 "redis://cache:6379/0",
		"redis://:s3cret@[bad":                                 "redis://…",
		// libpq's multi-host URLs, which url.Parse refuses with an IPv6
		// address among the hosts.
		"django-db+postgres://app:pw@db1:5432,db2:5432/app?target_session_attrs=read-write": "django-db+postgres://app:****@db1:5432,db2:5432/app?target_session_attrs=read-write",
		"postgres://app:pw@[::1]:5432,db2:5433/app?password=pw":                             "postgres://app:****@[::1]:5432,db2:5433/app?password=****",
		"postgres://[::1]:5432,[::2]/app":                                                   "postgres://[::1]:5432,[::2]/app",
		// The user info runs to the last '@': a password holding '/'.
		"postgres://app:pw/x,y@[::1]:5432,db2/app": "postgres://app:****@[::1]:5432,db2/app",
		"postgres://app:p@ss/w0rd@db1,db2/app":     "postgres://app:****@db1,db2/app",
	} {
		if got := URL(raw); got != want {
			t.Errorf("URL(%q) = %q, want %q", raw, got, want)
		}
	}
}

func TestText(t *testing.T) {
	t.Parallel()
	raw := "postgres://app:p@ss/W0rd-Tail@db1:5432,db2/app?sslmode=bogus"
	msg := "cannot parse `postgres://app:xxxxx@ss/W0rd-Tail@db1:5432,db2/app`: host ss, database W0rd-Tail@db1, user app: lookup ss on 10.0.0.1: no such host"
	got := Text(msg, raw)
	for _, leak := range []string{"W0rd", "@ss", "ss/", "ss "} {
		if strings.Contains(got, leak) {
			t.Errorf("Text shows %q: %s", leak, got)
		}
	}
	if !strings.Contains(got, "user app") || !strings.Contains(got, "postgres://app:") {
		t.Errorf("Text mangled the message: %s", got)
	}
}
