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
// without results end there.
type doneObserver struct {
	mu   sync.Mutex
	done map[string]time.Time
}

// newDoneObserver returns an observer with room for n tasks.
func newDoneObserver(n int) *doneObserver {
	return &doneObserver{done: make(map[string]time.Time, n)}
}

// Event implements tasks.Observer; it must not block.
func (o *doneObserver) Event(_ context.Context, typ string, fields map[string]any) {
	if typ != "task-succeeded" {
		return
	}
	id, _ := fields["uuid"].(string)
	o.record(id)
}

// TaskEvent implements tasks.TaskEventObserver, as control.Controller does:
// the worker then builds no field map for the events, which would be this
// measurement's own cost.
func (o *doneObserver) TaskEvent(_ context.Context, e *celeryproto.TaskEvent) {
	if e.Type == "task-succeeded" {
		o.record(e.UUID)
	}
}

func (o *doneObserver) record(id string) {
	now := time.Now()
	o.mu.Lock()
	o.done[id] = now
	o.mu.Unlock()
}

// write saves "task-id unix-nanoseconds" lines to path.
func (o *doneObserver) write(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	w := bufio.NewWriter(f)
	o.mu.Lock()
	for id, t := range o.done {
		fmt.Fprintf(w, "%s %d\n", id, t.UnixNano())
	}
	o.mu.Unlock()
	if err := w.Flush(); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

// readDone reads what write saved.
func readDone(path string) (map[string]time.Time, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }()
	out := map[string]time.Time{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var id string
		var ns int64
		if _, err := fmt.Sscanf(sc.Text(), "%s %d", &id, &ns); err != nil {
			return nil, fmt.Errorf("read %s: %w", path, err)
		}
		out[id] = time.Unix(0, ns)
	}
	return out, sc.Err()
}
