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
	} {
		if got := URL(raw); got != want {
			t.Errorf("URL(%q) = %q, want %q", raw, got, want)
		}
	}
}
