// Package redact hides the secrets of URLs before they reach a log line or
// an error: the password of the user info and query parameters whose name
// holds "password" become "****", as Celery's maybe_sanitize_url shows them.
package redact

import (
	"net/url"
	"strings"
)

// URL returns raw with its password hidden. A string that is not a URL
// keeps its scheme only.
func URL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		scheme, _, _ := strings.Cut(raw, "://")
		return scheme + "://…"
	}
	if u.User != nil {
		if _, has := u.User.Password(); has {
			u.User = url.UserPassword(u.User.Username(), "****")
		}
	}
	q := u.Query()
	for k := range q {
		if strings.Contains(strings.ToLower(k), "password") {
			q.Set(k, "****")
		}
	}
	if len(q) > 0 {
		u.RawQuery = q.Encode()
	}
	// url.URL escapes the stars.
	return strings.ReplaceAll(u.String(), "%2A%2A%2A%2A", "****")
}
