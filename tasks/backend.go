package tasks

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/clip"
	"github.com/onceler/onceler/internal/pause"
	"github.com/onceler/onceler/internal/redact"
)

// BackendSchemes are the result backend URL schemes a worker takes
// (Config.ResultBackend).
var BackendSchemes = []string{"rpc://", "redis://", "rediss://", "redis+socket://", "django-db+postgresql://"}

// DefaultResultExpires is Config.ResultExpires's default: one day, as
// Celery's result_expires.
const DefaultResultExpires = 24 * time.Hour

// resultBackend is where results go when it is not the rpc:// backend
// (results to the caller's reply queue, published by stage_answer.go).
type resultBackend interface {
	// put stores the encoded task meta of taskID and wakes the callers
	// waiting for it. It does not replace a SUCCESS already stored.
	put(ctx context.Context, taskID string, meta []byte) error
	// permanent reports whether put's error would come again for the same
	// result (retrying cannot help).
	permanent(err error) bool
	ping(ctx context.Context) error
	close() error
	// String is the backend's URL with its password hidden.
	String() string
}

// ErrBackendURL is returned (wrapped) for a result backend URL a worker
// cannot use.
var ErrBackendURL = errors.New("result backend")

// backendURLError is a refusal of a result backend URL, in one line that
// names the schemes that work. The URL itself is not repeated: it may hold
// a password.
func backendURLError(format string, a ...any) error {
	return fmt.Errorf("tasks: %w: %s (use %s)", ErrBackendURL, fmt.Sprintf(format, a...), strings.Join(BackendSchemes, ", "))
}

// newBackend opens the result backend of cfg.ResultBackend; nil for rpc://.
// It connects lazily: no connection is made here.
func newBackend(cfg *Config) (resultBackend, error) {
	raw := strings.TrimSpace(cfg.ResultBackend)
	if raw == "" {
		return nil, nil
	}
	scheme, _, ok := strings.Cut(raw, "://")
	if !ok {
		return nil, backendURLError("%q is not a URL", redactURL(raw))
	}
	switch s := strings.ToLower(scheme); {
	case s == "rpc":
		return nil, nil
	case s == "redis" || s == "rediss" || s == "redis+socket" || s == "socket":
		b, err := newRedisBackend(raw, cfg)
		if err != nil {
			return nil, err // not a typed nil in the interface
		}
		return b, nil
	case s == "django-db+postgresql" || s == "django-db+postgres":
		b, err := newDjangoBackend(raw, cfg)
		if err != nil {
			return nil, err
		}
		return b, nil
	case strings.HasPrefix(s, "db+"):
		return nil, backendURLError("Celery's SQLAlchemy backend (%s://) stores results as pickles, which onceler never writes", scheme)
	default:
		return nil, backendURLError("unsupported scheme %q", scheme)
	}
}

// CheckResultBackend reports whether a worker takes raw as its
// Config.ResultBackend: nil, or a one-line error (wrapping ErrBackendURL)
// that names the schemes that work and never shows the password.
func CheckResultBackend(raw string) error {
	b, err := newBackend(&Config{ResultBackend: raw})
	if b != nil {
		_ = b.close()
	}
	return err
}

// RedactResultBackend returns the result backend URL raw with its password
// hidden, for logs.
func RedactResultBackend(raw string) string {
	if strings.TrimSpace(raw) == "" {
		return "rpc://"
	}
	return redactURL(raw)
}

// redactURL returns raw with its password hidden (as Celery's
// maybe_sanitize_url hides it).
func redactURL(raw string) string { return redact.URL(raw) }

// storeResult writes r to the result backend before the delivery is
// acknowledged, retrying while the backend does not answer. It reports
// whether the delivery may now be acknowledged; false: the worker is
// stopping and the delivery was given back (its redelivery is answered
// from the record).
func (w *Worker) storeResult(ctx context.Context, j *job, r *celeryproto.Result) bool {
	r.Serializer = w.cfg.ResultSerializer
	_, meta, err := celeryproto.EncodeMeta(r, w.metaRequest(j, r.TaskID), time.Now())
	if err != nil {
		// Cannot happen for values that came from JSON; answer with a failure
		// the caller can read rather than nothing.
		w.log.Error("encode result", w.fields(j, zap.Error(err))...)
		r = &celeryproto.Result{TaskID: r.TaskID, Status: celeryproto.StateFailure, Serializer: r.Serializer,
			Exception: &celeryproto.Exception{Type: "EncodeError", Module: "kombu.exceptions", Message: err.Error()}}
		if _, meta, err = celeryproto.EncodeMeta(r, w.metaRequest(j, r.TaskID), time.Now()); err != nil {
			return true
		}
	}
	for attempt := 0; ; attempt++ {
		pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), opTimeout)
		err := w.backend.put(pctx, r.TaskID, meta)
		cancel()
		if err == nil {
			return true
		}
		if w.backend.permanent(err) {
			if r.Exception == nil || r.Exception.Type != "ResultNotStored" {
				// Tell the caller why, in a result the backend can keep (a
				// value too large for it, say).
				nr := &celeryproto.Result{TaskID: r.TaskID, Status: celeryproto.StateFailure, Serializer: r.Serializer,
					Exception: &celeryproto.Exception{Type: "ResultNotStored", Module: "onceler.exceptions",
						Message: "the result backend refused the result: " + clip.String(err.Error(), maxLogField)}}
				if _, nm, nerr := celeryproto.EncodeMeta(nr, w.metaRequest(j, r.TaskID), time.Now()); nerr == nil {
					r, meta = nr, nm
					continue
				}
			}
			w.log.Error("result refused by the result backend; the caller cannot be answered", w.fields(j,
				zap.String("result_task_id", clip.String(r.TaskID, maxLogField)), zap.String("status", string(r.Status)),
				zap.String("error", clip.String(err.Error(), maxLogField)))...)
			return true
		}
		if attempt%10 == 0 {
			w.log.Warn("result backend write failed; retrying, delivery held unacknowledged", w.fields(j,
				zap.Stringer("backend", w.backend), zap.Int("write_attempt", attempt+1),
				zap.String("error", clip.String(err.Error(), maxLogField)))...)
		}
		if ctx.Err() != nil || !pause.For(ctx, min(50*time.Millisecond<<min(attempt, 5), time.Second)) {
			w.log.Warn("result not stored; delivery requeued unanswered", w.fields(j, zap.String("error", clip.String(err.Error(), maxLogField)))...)
			w.giveBack(j)
			return false
		}
	}
}

// markStarted reports STARTED for the delivery j's task when
// Config.TrackStarted is set: to the result backend, or to the caller's
// reply queue (rpc://), as Celery's worker with task_track_started. One
// attempt, bounded: the outcome comes later whatever happens to it.
func (w *Worker) markStarted(ctx context.Context, j *job) {
	if !w.cfg.TrackStarted || j.msg == nil {
		return
	}
	r := &celeryproto.Result{TaskID: j.msg.ID, Status: celeryproto.StateStarted, Serializer: w.cfg.ResultSerializer,
		Value: map[string]any{"pid": int64(os.Getpid()), "hostname": w.cfg.Hostname}}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
	defer cancel()
	var err error
	switch {
	case w.backend != nil:
		var meta []byte
		if _, meta, err = celeryproto.EncodeMeta(r, w.metaRequest(j, r.TaskID), time.Now()); err == nil {
			err = w.backend.put(ctx, r.TaskID, meta)
		}
	case j.msg.ReplyTo != "":
		var pub *celeryproto.Publishing
		if pub, err = celeryproto.EncodeResult(r); err == nil {
			if len(pub.CorrelationID) > maxShortString {
				pub.CorrelationID = ""
			}
			err = w.pub.Publish(ctx, "", j.msg.ReplyTo, pub, amqp.PublishOptions{})
		}
	}
	if err != nil {
		w.log.Warn("STARTED not reported", w.fields(j, zap.String("error", clip.String(err.Error(), maxLogField)))...)
	}
}

// metaRequest is what the backend keeps of the request beside the result
// of taskID: the delivery's own request, or nothing for another task id
// (a chain step failed along with it).
func (w *Worker) metaRequest(j *job, taskID string) *celeryproto.MetaRequest {
	m := j.msg
	if m == nil || m.ID != taskID {
		return nil
	}
	req := &celeryproto.MetaRequest{GroupID: m.GroupID, ParentID: m.ParentID}
	if w.cfg.ResultExtended {
		req.Extended = true
		req.Name, req.Args, req.Kwargs = m.Task, m.Args, m.Kwargs
		req.Worker, req.Retries, req.Queue = w.cfg.Hostname, m.Retries, j.d.origin().RoutingKey
	}
	return req
}

// checkBackend pings the result backend at start: a backend that does not
// answer is reported, not fatal (results wait, their deliveries held, until
// it answers).
func (w *Worker) checkBackend(ctx context.Context) {
	if w.backend == nil {
		return
	}
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := w.backend.ping(pctx); err != nil {
		w.log.Warn("result backend does not answer yet; results wait for it", zap.Stringer("backend", w.backend),
			zap.String("error", clip.String(err.Error(), maxLogField)))
		return
	}
	w.log.Info("result backend", zap.Stringer("backend", w.backend), zap.Duration("result_expires", w.cfg.ResultExpires),
		zap.Bool("result_extended", w.cfg.ResultExtended))
}

func (w *Worker) closeBackend() {
	if w.backend != nil {
		if err := w.backend.close(); err != nil {
			w.log.Warn("close result backend", zap.Error(err))
		}
	}
}
