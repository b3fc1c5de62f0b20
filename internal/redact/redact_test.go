package redact

import "testing"

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
		"postgres://app:pw/x,y@[::1]:5432,db2/app":                                          "postgres://…",
	} {
		if got := URL(raw); got != want {
			t.Errorf("URL(%q) = %q, want %q", raw, got, want)
		}
	}
}
