package main

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/onceler/onceler/celeryproto"
)

// doneObserver records when each task's outcome was committed: the worker
// emits task-succeeded after the record says completed (the claim and the
// completion, or the same-database transaction, committed), just before it
// publishes the result and acknowledges. The latency runs of scenarios
// without results end there. With stages it also records when each task's
// task-received (decoded, on arrival) and task-started (claimed, about to
// run) were emitted, for -latency-dump.
type doneObserver struct {
	stages bool

	mu   sync.Mutex
	done map[string]taskTimes
}

// taskTimes are the moments a task's events were emitted; zero: not seen.
type taskTimes struct{ received, started, done time.Time }

// newDoneObserver returns an observer with room for n tasks.
func newDoneObserver(n int) *doneObserver {
	return &doneObserver{done: make(map[string]taskTimes, n)}
}

// Event implements tasks.Observer; it must not block.
func (o *doneObserver) Event(_ context.Context, typ string, fields map[string]any) {
	id, _ := fields["uuid"].(string)
	o.record(typ, id)
}

// TaskEvent implements tasks.TaskEventObserver, as control.Controller does:
// the worker then builds no field map for the events, which would be this
// measurement's own cost.
func (o *doneObserver) TaskEvent(_ context.Context, e *celeryproto.TaskEvent) {
	o.record(e.Type, e.UUID)
}

func (o *doneObserver) record(typ, id string) {
	if typ != "task-succeeded" && (!o.stages || typ != "task-received" && typ != "task-started") {
		return
	}
	now := time.Now()
	o.mu.Lock()
	t := o.done[id]
	switch typ {
	case "task-received":
		t.received = now
	case "task-started":
		t.started = now
	default:
		t.done = now
	}
	o.done[id] = t
	o.mu.Unlock()
}

// write saves "task-id done received started" lines (Unix nanoseconds, 0
// when not seen) to path.
func (o *doneObserver) write(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	w := bufio.NewWriter(f)
	o.mu.Lock()
	for id, t := range o.done {
		fmt.Fprintf(w, "%s %d %d %d\n", id, unixNano(t.done), unixNano(t.received), unixNano(t.started))
	}
	o.mu.Unlock()
	if err := w.Flush(); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

func unixNano(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

func fromUnixNano(ns int64) time.Time {
	if ns == 0 {
		return time.Time{}
	}
	return time.Unix(0, ns)
}

// readDone reads what write saved.
func readDone(path string) (map[string]taskTimes, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }()
	out := map[string]taskTimes{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var id string
		var done, received, started int64
		if _, err := fmt.Sscanf(sc.Text(), "%s %d %d %d", &id, &done, &received, &started); err != nil {
			return nil, fmt.Errorf("read %s: %w", path, err)
		}
		out[id] = taskTimes{received: fromUnixNano(received), started: fromUnixNano(started), done: fromUnixNano(done)}
	}
	return out, sc.Err()
}
