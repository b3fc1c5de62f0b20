package tasks

import (
	"context"
	"net/http"
	"os"
	"time"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/control"
)

// Registered returns the names of the tasks this worker serves, sorted.
func (w *Worker) Registered() []string { return w.reg.Names() }

// Queues returns the queues the worker consumes, as found on the broker
// at the last connect (amqp.Consumer.Queues): with the arguments the broker
// holds for them.
func (w *Worker) Queues() []amqp.QueueSpec {
	if t, ok := w.tr.(*amqpTransport); ok {
		return t.consumer.Queues()
	}
	return nil
}

// Hostname returns the worker's node name.
func (w *Worker) Hostname() string { return w.cfg.Hostname }

func (w *Worker) info(j *job, started time.Time) control.TaskInfo {
	o := j.d.origin()
	ti := control.TaskInfo{Started: started, Queue: o.Queue, Exchange: o.Exchange, RoutingKey: o.RoutingKey,
		Priority: o.Priority, Redelivered: j.d.redelivered(), Hostname: w.cfg.Hostname}
	if j.msg != nil {
		ti.ID, ti.Name, ti.ArgsRepr, ti.KwargsRepr, ti.ETA = j.msg.ID, j.msg.Task, j.msg.ArgsRepr, j.msg.KwargsRepr, j.msg.ETA
		ti.Args, ti.Kwargs = j.msg.Args, j.msg.Kwargs
	} else {
		// Not decoded yet (waiting for room in the memory budget): what
		// the protocol 2 headers say.
		d := j.d.wire()
		ti.ID, _ = d.Headers["id"].(string)
		if ti.ID == "" {
			ti.ID = d.CorrelationID
		}
		ti.Name, _ = d.Headers["task"].(string)
		ti.ArgsRepr, _ = d.Headers["argsrepr"].(string)
		ti.KwargsRepr, _ = d.Headers["kwargsrepr"].(string)
	}
	return ti
}

// Active returns the tasks running now.
func (w *Worker) Active() []control.TaskInfo {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make([]control.TaskInfo, 0, len(w.active))
	for j, rs := range w.active {
		out = append(out, w.info(j, rs.started))
	}
	return out
}

// Reserved returns the deliveries received and waiting to run, decoded on
// arrival (stage_arrive.go): not those running, nor those held for an ETA
// still ahead.
func (w *Worker) Reserved() []control.TaskInfo {
	w.mu.Lock()
	defer w.mu.Unlock()
	now := time.Now()
	out := make([]control.TaskInfo, 0, len(w.reserved))
	for j := range w.reserved {
		if w.active[j] != nil {
			continue
		}
		if _, held := w.held[j]; held || (j.msg != nil && now.Before(j.msg.ETA)) {
			continue
		}
		out = append(out, w.info(j, time.Time{}))
	}
	return out
}

// Scheduled returns the deliveries held until their ETA.
func (w *Worker) Scheduled() []control.TaskInfo {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []control.TaskInfo
	for j := range w.timers {
		if j.msg != nil && !j.msg.ETA.IsZero() && time.Now().Before(j.msg.ETA) {
			out = append(out, w.info(j, time.Time{}))
		}
	}
	return out
}

// Revoke marks task ids revoked: a revoked delivery is answered REVOKED
// (TaskRevokedError) on receipt or before it runs. With terminate, a
// running task with that id has its context cancelled (cause ErrRevoked).
// The set keeps the last 50,000 ids, each for Config.RevokedExpiry (3 h).
func (w *Worker) Revoke(ids []string, terminate bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, id := range ids {
		w.revoked.add(id)
	}
	if !terminate {
		return
	}
	want := make(map[string]bool, len(ids))
	for _, id := range ids {
		want[id] = true
	}
	for j, rs := range w.active {
		if j.msg != nil && want[j.msg.ID] {
			rs.cancel(ErrRevoked)
		}
	}
}

func (w *Worker) isRevoked(id string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.revoked.has(id)
}

// Stats returns counters in the shape of Celery's inspect stats.
func (w *Worker) Stats() map[string]any {
	w.mu.Lock()
	total := make(map[string]any, len(w.totals))
	for k, v := range w.totals {
		total[k] = v
	}
	scheduled := w.scheduled
	started := w.started
	w.mu.Unlock()
	uptime := 0
	if !started.IsZero() {
		uptime = int(time.Since(started).Seconds())
	}
	return map[string]any{
		"total":          total,
		"pid":            os.Getpid(),
		"uptime":         uptime,
		"prefetch_count": w.cfg.Prefetch + scheduled,
		"pool": map[string]any{
			"implementation":  "onceler:goroutines",
			"max-concurrency": w.PoolSize(),
			"processes":       []int{os.Getpid()},
		},
		"broker": w.brokerInfo(),
	}
}

// revokedSet is a bounded set of ids whose members expire, as Celery's
// LimitedSet of revoked ids (maxlen 50,000, expires 3 h): the oldest leave
// first when it is full, and an id is forgotten ttl after it was (last)
// added.
type revokedSet struct {
	max   int
	ttl   time.Duration
	now   func() time.Time
	seq   uint64
	ids   map[string]revokedEntry // id -> its latest add
	order []revokedEntry          // by time added; entries re-added later are skipped
}

type revokedEntry struct {
	id  string
	at  time.Time
	seq uint64
}

func newRevokedSet(n int, ttl time.Duration) revokedSet {
	return revokedSet{max: n, ttl: ttl, now: time.Now, ids: make(map[string]revokedEntry)}
}

func (s *revokedSet) add(id string) {
	now := s.now()
	s.seq++
	e := revokedEntry{id, now, s.seq}
	s.ids[id] = e
	s.order = append(s.order, e)
	s.purge(now)
	if len(s.order) > 2*len(s.ids)+64 {
		// Ids revoked again and again: drop their superseded entries.
		live := s.order[:0]
		for _, e := range s.order {
			if s.ids[e.id].seq == e.seq {
				live = append(live, e)
			}
		}
		clear(s.order[len(live):])
		s.order = live
	}
}

func (s *revokedSet) has(id string) bool {
	now := s.now()
	s.purge(now)
	e, ok := s.ids[id]
	return ok && now.Sub(e.at) < s.ttl
}

// purge drops expired ids and, past max, the oldest.
func (s *revokedSet) purge(now time.Time) {
	for len(s.order) > 0 {
		e := s.order[0]
		switch {
		case s.ids[e.id].seq != e.seq:
			// Superseded by a later add (or gone): skip.
		case len(s.ids) > s.max || now.Sub(e.at) >= s.ttl:
			delete(s.ids, e.id)
		default:
			return
		}
		s.order[0] = revokedEntry{}
		s.order = s.order[1:]
	}
}

func (s *revokedSet) len() int { return len(s.ids) }

// event hands a task event to the Observer, with Celery's common task
// fields: uuid always; the task name on the delivery's first event
// (task-received, as Celery sends it) and the operation key's hash on the
// first event once the key is known. Readers (celery.events.State, Flower)
// merge a task's events, so repeating them would only make every event
// longer. An Observer with a TaskEvent method gets the value; any other gets
// its fields as a map.
func (w *Worker) event(ctx context.Context, j *job, e *celeryproto.TaskEvent) {
	if w.obs == nil || j.msg == nil {
		return
	}
	e.UUID = j.msg.ID
	if !j.named {
		if e.Name == "" {
			e.Name = j.msg.Task
		}
		j.named = true
	}
	if j.key != "" && !j.keyed {
		e.KeyHash = celeryproto.KeyHash(j.key)
		j.keyed = true
	}
	if w.taskObs != nil {
		w.taskObs.TaskEvent(ctx, e)
		return
	}
	w.obs.Event(ctx, e.Type, e.Fields())
}

func receivedEvent(j *job) *celeryproto.TaskEvent {
	m := j.msg
	e := &celeryproto.TaskEvent{Type: "task-received", Args: m.ArgsRepr, Kwargs: m.KwargsRepr,
		RootID: m.RootID, ParentID: m.ParentID, Retries: m.Retries}
	if !m.ETA.IsZero() {
		e.ETA = celeryproto.FormatTime(m.ETA)
	}
	if !m.Expires.IsZero() {
		e.Expires = celeryproto.FormatTime(m.Expires)
	}
	return e
}

// HealthHandler serves /healthz (200 while Run runs) and /readyz (200 only
// while consuming, the database answers and the worker is not stalled;
// 503 otherwise).
func (w *Worker) HealthHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(rw http.ResponseWriter, _ *http.Request) {
		if !w.running.Load() {
			http.Error(rw, "not running", http.StatusServiceUnavailable)
			return
		}
		_, _ = rw.Write([]byte("ok\n"))
	})
	mux.HandleFunc("/readyz", func(rw http.ResponseWriter, r *http.Request) {
		if !w.ready(r.Context()) {
			http.Error(rw, "not ready", http.StatusServiceUnavailable)
			return
		}
		_, _ = rw.Write([]byte("ready\n"))
	})
	return mux
}
