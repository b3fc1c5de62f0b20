// Package redact hides the secrets of URLs before they reach a log line or
// an error: the password of the user info and query parameters whose name
// holds "password" become "****", as Celery's maybe_sanitize_url shows them.
package redact

import (
	"net/url"
	"regexp"
	"strings"
)

// URL returns raw with its password hidden. A string that is not a URL
// keeps its scheme only.
func URL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		if r, ok := multiHost(raw); ok {
			return r
		}
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

// hostsPlaceholder stands for a host list while the rest of a URL is
// redacted.
const hostsPlaceholder = "onceler-hosts.invalid"

// hostList matches a list of host[:port], a host a name, an IPv4 address or
// a bracketed IPv6 address.
var hostList = regexp.MustCompile(`^(?:\[[0-9A-Fa-f:.%a-z]+\]|[A-Za-z0-9._-]*)(?::[0-9]*)?(?:,(?:\[[0-9A-Fa-f:.%a-z]+\]|[A-Za-z0-9._-]*)(?::[0-9]*)?)+$`)

// multiHost redacts a libpq URL listing several hosts
// (postgres://user:pw@[::1]:5432,db2:5432/app), which url.Parse refuses
// when a host is an IPv6 address: the host list is set aside, the rest
// redacted as one URL, and the list put back.
func multiHost(raw string) (string, bool) {
	scheme, rest, ok := strings.Cut(raw, "://")
	if !ok {
		return "", false
	}
	end := strings.IndexAny(rest, "/?#")
	if end < 0 {
		end = len(rest)
	}
	authority, tail := rest[:end], rest[end:]
	userinfo, hosts := "", authority
	if at := strings.LastIndex(authority, "@"); at >= 0 {
		userinfo, hosts = authority[:at+1], authority[at+1:]
	}
	// A '@' after the host list means the user info held a '/' (not a
	// libpq URL): nothing is put back that could be part of a password.
	if !strings.Contains(hosts, ",") || !hostList.MatchString(hosts) || (userinfo == "" && strings.Contains(tail, "@")) {
		return "", false
	}
	u, err := url.Parse(scheme + "://" + userinfo + hostsPlaceholder + tail)
	if err != nil {
		return "", false
	}
	return strings.Replace(URL(u.String()), hostsPlaceholder, hosts, 1), true
}
