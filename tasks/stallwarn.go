package tasks

import (
	"errors"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"
)

// Reasons a delivery is held without progress, as the warnings name them.
const (
	stallRecord   = "record unavailable"
	stallSchema   = "record schema missing"
	stallInFlight = "claim in progress elsewhere"
)

// stallWarn limits the warnings about deliveries held without progress to
// one per reason per interval, counting the ones it kept quiet.
type stallWarn struct {
	mu    sync.Mutex
	last  map[string]time.Time
	quiet map[string]int
}

// allow reports whether a warning for reason may be logged now (none was in
// the last interval), and how many were kept quiet since the last one.
func (s *stallWarn) allow(reason string, interval time.Duration, now time.Time) (bool, int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.last == nil {
		s.last, s.quiet = map[string]time.Time{}, map[string]int{}
	}
	if last, ok := s.last[reason]; ok && now.Sub(last) < interval {
		s.quiet[reason]++
		return false, 0
	}
	n := s.quiet[reason]
	s.last[reason], s.quiet[reason] = now, 0
	return true, n
}

// warnStall logs, at most once per lease per reason, that deliveries are
// held without progress and why.
func (w *Worker) warnStall(reason, msg string, j *job, fields ...zap.Field) {
	ok, quiet := w.stalls.allow(reason, w.cfg.Lease, time.Now())
	if !ok {
		return
	}
	fields = append(fields, zap.String("reason", reason), zap.Duration("held", time.Since(j.received).Round(time.Millisecond)))
	if quiet > 0 {
		fields = append(fields, zap.Int("repeats_not_logged", quiet))
	}
	w.log.Warn(msg, w.fields(j, fields...)...)
}

// schemaMissing reports whether err says the record's schema or tables do
// not exist (dropped, or never migrated).
func schemaMissing(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "42P01" || pgErr.Code == "3F000")
}
