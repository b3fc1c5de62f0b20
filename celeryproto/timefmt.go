package celeryproto

import (
	"fmt"
	"strings"
	"time"

	"github.com/onceler/onceler/internal/clip"
)

var timeLayouts = []string{
	"2006-01-02T15:04:05.999999999Z07:00", // fraction optional; Z or +hh:mm
	"2006-01-02T15:04:05.999999999",       // naive: UTC
	"2006-01-02T15:04:05.999999999Z0700",
	"2006-01-02T15:04:05.999999999Z07",
	"2006-01-02T15:04Z07:00",
	"2006-01-02T15:04",
	"2006-01-02",
}

// ParseTime parses every time form Celery and kombu send: ISO 8601 with or
// without a fraction (any number of digits), with "Z", an offset (+hh:mm,
// +hhmm, +hh) or none (naive times are UTC), a "T" or a space between date
// and time, and a bare date. The result is in UTC.
func ParseTime(s string) (time.Time, error) {
	v := strings.TrimSpace(s)
	if len(v) > 10 && v[10] == ' ' {
		v = v[:10] + "T" + v[11:]
	}
	for _, layout := range timeLayouts {
		if t, err := time.Parse(layout, v); err == nil {
			return t.UTC(), nil
		}
	}
	return time.Time{}, fmt.Errorf("unparsable time %q", clip.String(s, 64))
}

// FormatTime writes t the way Celery 5.2 itself writes and parses times:
// UTC, exactly 6 fraction digits and "+00:00".
func FormatTime(t time.Time) string {
	var b [32]byte
	return string(appendTime(b[:0], t))
}

func appendTime(b []byte, t time.Time) []byte {
	b = t.UTC().AppendFormat(b, "2006-01-02T15:04:05.000000")
	return append(b, "+00:00"...)
}
