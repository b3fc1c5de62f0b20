// Package redact hides the secrets of URLs before they reach a log line or
// an error: the password of the user info and query parameters whose name
// holds "password" become "****", as Celery's maybe_sanitize_url shows them.
package redact

import (
	"net/url"
	"regexp"
	"slices"
	"strings"
)

// userinfo splits raw, scheme://userinfo@rest, at its user info: all the
// text between "://" and the last '@' before any '?' (a password may hold
// '@' and '/' written as is, which url.Parse would take for the host or the
// path). ok is false when raw has no user info.
func userinfo(raw string) (prefix, info, rest string, ok bool) {
	i := strings.Index(raw, "://")
	if i < 0 {
		return "", "", "", false
	}
	start := i + 3
	end := len(raw)
	if q := strings.IndexByte(raw[start:], '?'); q >= 0 {
		end = start + q
	}
	at := strings.LastIndexByte(raw[start:end], '@')
	if at < 0 {
		return "", "", "", false
	}
	return raw[:start], raw[start : start+at], raw[start+at:], true
}

// Secrets returns the spellings in which the password of raw (a URL, as
// userinfo reads it, or a password= query parameter) may be quoted by a
// message: whole, percent-decoded, and each of its parts between '@' and
// '/' (a parser that splits the user info at its first '@' or '/' shows the
// rest as host, path or database name); longest first.
func Secrets(raw string) []string {
	var pws []string
	if _, info, _, ok := userinfo(raw); ok {
		if _, pw, has := strings.Cut(info, ":"); has && pw != "" {
			pws = append(pws, pw)
		}
	}
	if _, q, ok := strings.Cut(raw, "?"); ok {
		for _, kv := range strings.Split(q, "&") {
			k, v, _ := strings.Cut(kv, "=")
			if strings.Contains(strings.ToLower(k), "password") && v != "" {
				pws = append(pws, v)
			}
		}
	}
	seen := map[string]bool{}
	var out []string
	add := func(v string) {
		if v != "" && !seen[v] {
			seen[v] = true
			out = append(out, v)
		}
	}
	for _, pw := range pws {
		for _, v := range []string{pw, unescape(pw)} {
			add(v)
			for _, f := range strings.FieldsFunc(v, func(r rune) bool { return r == '@' || r == '/' }) {
				add(f)
			}
		}
	}
	slices.SortFunc(out, func(a, b string) int { return len(b) - len(a) })
	return out
}

func unescape(s string) string {
	if v, err := url.PathUnescape(s); err == nil {
		return v
	}
	return s
}

// Text returns text, a message that may quote raw (a URL; pgx's errors,
// which mask a password only up to its first '@'), with every spelling of
// raw's password (Secrets) replaced by "****". A part of the password
// shorter than 4 characters is replaced only as a whole word (as a misread
// URL shows it: a host name, a database name), so that it does not mangle
// the message.
func Text(text, raw string) string {
	for _, s := range Secrets(raw) {
		if len(s) >= 4 {
			text = strings.ReplaceAll(text, s, "****")
			continue
		}
		re := regexp.MustCompile(`(^|[^A-Za-z0-9_.-])` + regexp.QuoteMeta(s) + `([^A-Za-z0-9_.-]|$)`)
		for { // overlapping matches: "ss ss"
			t := re.ReplaceAllString(text, "${1}****${2}")
			if t == text {
				break
			}
			text = t
		}
	}
	return text
}

// URL returns raw with its password hidden. A string that is not a URL
// keeps its scheme only.
func URL(raw string) string {
	if prefix, info, rest, ok := userinfo(raw); ok {
		if user, _, has := strings.Cut(info, ":"); has {
			if strings.ContainsAny(user, "/@?#") {
				scheme, _, _ := strings.Cut(raw, "://")
				return scheme + "://…"
			}
			raw = prefix + user + ":****" + rest
		}
	}
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
