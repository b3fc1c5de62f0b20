package control

import (
	"container/list"
	"math"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Revoked is a bounded set of revoked task ids with expiry, like Celery's
// worker_state.revoked (a LimitedSet): at most max ids, each forgotten ttl
// after it was added; when full, the oldest id goes first. It is safe for
// concurrent use.
type Revoked struct {
	mu    sync.Mutex
	max   int
	ttl   time.Duration
	now   func() time.Time
	order *list.List // of revokedEntry, oldest first
	ids   map[string]*list.Element
}

type revokedEntry struct {
	id string
	at time.Time
}

// NewRevoked returns an empty set keeping at most max ids for ttl each
// (defaults DefaultRevokedMax and DefaultRevokedTTL when not positive).
func NewRevoked(max int, ttl time.Duration) *Revoked {
	if max <= 0 {
		max = DefaultRevokedMax
	}
	if ttl <= 0 {
		ttl = DefaultRevokedTTL
	}
	return &Revoked{max: max, ttl: ttl, now: time.Now, order: list.New(), ids: map[string]*list.Element{}}
}

// Add records ids as revoked now (an id already present is refreshed).
func (r *Revoked) Add(ids ...string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	r.purge(now)
	for _, id := range ids {
		if id == "" {
			continue
		}
		if e, ok := r.ids[id]; ok {
			e.Value = revokedEntry{id: id, at: now}
			r.order.MoveToBack(e)
			continue
		}
		r.ids[id] = r.order.PushBack(revokedEntry{id: id, at: now})
		for r.order.Len() > r.max {
			r.remove(r.order.Front())
		}
	}
}

// Contains reports whether id is revoked (and not yet expired).
func (r *Revoked) Contains(id string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	e, ok := r.ids[id]
	if !ok {
		return false
	}
	if r.now().Sub(e.Value.(revokedEntry).at) >= r.ttl {
		r.remove(e)
		return false
	}
	return true
}

// Len returns the number of ids held (expired ones are dropped first).
func (r *Revoked) Len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.purge(r.now())
	return r.order.Len()
}

// Snapshot returns the ids with the Unix time each was revoked, oldest
// first (the form Celery's mingle exchanges).
func (r *Revoked) Snapshot() map[string]float64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.purge(r.now())
	out := make(map[string]float64, r.order.Len())
	for e := r.order.Front(); e != nil; e = e.Next() {
		v := e.Value.(revokedEntry)
		out[v.id] = float64(v.at.UnixNano()) / 1e9
	}
	return out
}

// IDs returns the revoked ids, oldest first.
func (r *Revoked) IDs() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.purge(r.now())
	out := make([]string, 0, r.order.Len())
	for e := r.order.Front(); e != nil; e = e.Next() {
		out = append(out, e.Value.(revokedEntry).id)
	}
	return out
}

func (r *Revoked) purge(now time.Time) {
	for e := r.order.Front(); e != nil && now.Sub(e.Value.(revokedEntry).at) >= r.ttl; e = r.order.Front() {
		r.remove(e)
	}
}

func (r *Revoked) remove(e *list.Element) {
	delete(r.ids, e.Value.(revokedEntry).id)
	r.order.Remove(e)
}

// monotonic is Python's time.monotonic() on this host: CLOCK_MONOTONIC in
// seconds, the clock of Celery's LimitedSet.
func monotonic() float64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		return float64(time.Now().UnixNano()) / 1e9
	}
	return float64(ts.Sec) + float64(ts.Nsec)/1e9
}

// limitedSetData returns the ids as Celery's LimitedSet keeps them in its
// _data, which Celery's workers exchange in mingle's hello: id to
// [monotonic time it was revoked, id]. A Python worker that merges them
// expires each by its age, as it does its own.
func (r *Revoked) limitedSetData() map[string]any {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	r.purge(now)
	mono := monotonic()
	out := make(map[string]any, r.order.Len())
	for e := r.order.Front(); e != nil; e = e.Next() {
		v := e.Value.(revokedEntry)
		t := mono - now.Sub(v.at).Seconds()
		if t == math.Trunc(t) {
			t += 1e-6 // LimitedSet.update wants a float, which JSON keeps only with a fraction
		}
		out[v.id] = []any{t, v.id}
	}
	return out
}

// addAged records id as revoked age ago (an id already present is
// refreshed); one older than the set's expiry is not added.
func (r *Revoked) addAged(id string, age time.Duration) {
	if id == "" {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	r.purge(now)
	if age >= r.ttl {
		return
	}
	at := now.Add(-max(age, 0))
	if e, ok := r.ids[id]; ok {
		if !e.Value.(revokedEntry).at.Before(at) {
			return
		}
		r.remove(e)
	}
	// keep the list in order of time: walk back from the newest
	mark := r.order.Back()
	for mark != nil && mark.Value.(revokedEntry).at.After(at) {
		mark = mark.Prev()
	}
	if mark == nil {
		r.ids[id] = r.order.PushFront(revokedEntry{id: id, at: at})
	} else {
		r.ids[id] = r.order.InsertAfter(revokedEntry{id: id, at: at}, mark)
	}
	for r.order.Len() > r.max {
		r.remove(r.order.Front())
	}
}
