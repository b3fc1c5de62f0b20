package control

import (
	"cmp"
	"context"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/onceler/onceler/internal/clip"
)

// Bounds of the revoke command's reply and log line. A revoke may name any
// number of ids (a million task ids is a 40 MB message); Celery's reply
// lists them all, which would make a reply as large as the request and a
// log line as large again.
const (
	// revokeReplyBytes bounds the ids listed in a revoke reply: the rest
	// are counted ("... and 99990 more").
	revokeReplyBytes = 4096
	// revokeLogIDs and revokeLogIDBytes bound the ids a revoke logs, and
	// each id's length there.
	revokeLogIDs     = 10
	revokeLogIDBytes = 64
)

// revoke marks ids revoked, as Celery's revoke command: task_id is one id or
// a list of ids. It takes time linear in the number of ids and keeps at
// most Config.RevokedMax of them: the last ones given, since adding more ids
// than the set holds would evict the earlier ones anyway (Celery's set holds
// 50,000 too). With terminate, a running task named anywhere in the list is
// cancelled. It stops early, having revoked only part of the ids, when ctx
// ends (the worker is shutting down and forgets revoked ids anyway).
func (c *Controller) revoke(ctx context.Context, arg any, terminate bool) map[string]any {
	var active map[string]bool
	if terminate {
		active = map[string]bool{}
		for _, t := range c.worker().Active() {
			active[t.ID] = true
		}
	}
	var (
		running []string
		keep    []string // newest first
		seen    = map[string]bool{}
		total   int
	)
	visit := func(id string) {
		total++
		if active[id] {
			running = append(running, id)
			delete(active, id)
		}
	}
	switch v := arg.(type) {
	case string:
		if v != "" {
			visit(v)
			seen[v] = true
			keep = append(keep, v)
		}
	case []any:
		// Newest last: walk backwards so that the kept ids are the last
		// RevokedMax distinct ones.
		for i := len(v) - 1; i >= 0; i-- {
			if i%4096 == 0 && ctx.Err() != nil {
				return nok("revoke: interrupted by shutdown")
			}
			s, ok := v[i].(string)
			if !ok || s == "" {
				continue
			}
			visit(s)
			if len(keep) < c.cfg.RevokedMax && !seen[s] {
				seen[s] = true
				keep = append(keep, s)
			}
		}
	}
	if total == 0 {
		return nok("revoke: no task_id given")
	}
	slices.Reverse(keep)
	c.revoked.Add(keep...)
	c.worker().Revoke(keep, terminate)
	var beyond []string // running ids named but not among those kept
	for _, id := range running {
		if !seen[id] {
			beyond = append(beyond, id)
		}
	}
	if len(beyond) > 0 {
		c.worker().Revoke(beyond, true)
	}
	first, rest := firstIDs(arg, total, revokeReplyBytes)
	logged := make([]string, 0, revokeLogIDs)
	for _, id := range first[:min(len(first), revokeLogIDs)] {
		if len(id) > revokeLogIDBytes {
			id = clip.Prefix(id, revokeLogIDBytes) + "…"
		}
		logged = append(logged, id)
	}
	c.log.Info("tasks revoked", zap.Int("count", total), zap.Strings("first_ids", logged),
		zap.Int("kept", len(keep)), zap.Bool("terminate", terminate))
	if terminate {
		if len(running) == 0 {
			return ok("terminate: tasks unknown")
		}
		slices.Reverse(running)
		return ok("terminate: " + joinBounded(running, 0, revokeReplyBytes))
	}
	return ok("tasks " + joinBounded(first, rest, revokeReplyBytes) + " flagged as revoked")
}

// firstIDs returns the first ids of a revoke's task_id argument (one id or
// a list), in order, each once, up to about limit bytes of them, and how
// many entries of the argument follow them.
func firstIDs(arg any, total, limit int) (first []string, rest int) {
	listed := map[string]bool{}
	size, walked := 0, 0
	walk := func(id string) bool {
		if !listed[id] {
			if size += len(id) + 2; size > limit {
				return false
			}
			listed[id] = true
			first = append(first, id)
		}
		walked++
		return true
	}
	switch v := arg.(type) {
	case string:
		walk(v)
	case []any:
		for _, x := range v {
			if s, ok := x.(string); ok && s != "" && !walk(s) {
				break
			}
		}
	}
	return first, total - walked
}

// joinBounded joins ids with ", " as Celery does, at most about limit bytes
// of them, and counts those left out with rest more: "a, b and 99998 more".
func joinBounded(ids []string, rest, limit int) string {
	var b strings.Builder
	n := 0
	for _, id := range ids {
		if b.Len()+len(id) > limit {
			break
		}
		if n > 0 {
			b.WriteString(", ")
		}
		b.WriteString(id)
		n++
	}
	rest += len(ids) - n
	switch {
	case rest == 0:
	case n == 0 && rest == 1:
		return "1 id"
	case n == 0:
		return strconv.Itoa(rest) + " ids"
	default:
		b.WriteString(" and " + strconv.Itoa(rest) + " more")
	}
	return b.String()
}

// mergeRevoked takes the revoked ids another node sent in a hello: the
// newest Config.RevokedMax of them. A Celery worker sends its LimitedSet's
// _data, id to [monotonic time, id] (Python's time.monotonic on its host):
// such an id keeps its age, and one past the expiry is dropped, as Celery's
// LimitedSet.update does. An id given a plain number (onceler workers once
// sent Unix times) counts as revoked now.
func (c *Controller) mergeRevoked(r map[string]any) {
	type entry struct {
		id   string
		at   float64
		aged bool
	}
	all := make([]entry, 0, len(r))
	for id, at := range r {
		e := entry{id: id}
		if l, ok := at.([]any); ok && len(l) > 0 {
			e.aged = true
			at = l[0]
		}
		switch x := at.(type) {
		case float64:
			e.at = x
		case int64:
			e.at = float64(x)
		}
		all = append(all, e)
	}
	if len(all) > c.cfg.RevokedMax {
		slices.SortFunc(all, func(a, b entry) int { return cmp.Compare(b.at, a.at) })
		all = all[:c.cfg.RevokedMax]
	}
	slices.SortFunc(all, func(a, b entry) int { return cmp.Compare(a.at, b.at) }) // oldest first
	mono := monotonic()
	ids := make([]string, 0, len(all))
	for _, e := range all {
		if !e.aged {
			c.revoked.Add(e.id)
			ids = append(ids, e.id)
			continue
		}
		age := time.Duration((mono - e.at) * float64(time.Second))
		if age >= c.revoked.ttl {
			continue
		}
		c.revoked.addAged(e.id, age)
		ids = append(ids, e.id)
	}
	c.worker().Revoke(ids, false)
}
