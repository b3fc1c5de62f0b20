package main

import (
	"bytes"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

// brokerSpawnMark is in the command line of the Erlang VM RabbitMQ starts
// once a minute: its epmd monitor (rabbit_epmd_monitor, every 60 s) calls
// rabbit_nodes:ensure_epmd(), which boots a whole `erl -sname
// epmd-starter-...` node to make sure epmd runs. On two cores that VM takes
// most of the machine for about half a second, and every process on it
// waits: a latency run it overlaps has a p99 of 50 to 90 ms whatever the
// consumer, a burst no consumer causes or can avoid.
const brokerSpawnMark = "epmd-starter"

// spawnWatch notes the processes started on the machine whose command line
// holds a mark. It reads /proc/loadavg (whose last field is the most recent
// process id) every few milliseconds, and the command line of each new
// process id: cheap enough to run beside a measurement.
type spawnWatch struct {
	mark []byte
	stop chan struct{}
	done chan struct{}

	mu   sync.Mutex
	seen []time.Time
}

// watchSpawns starts watching for processes whose command line holds mark.
func watchSpawns(mark string) *spawnWatch {
	w := &spawnWatch{mark: []byte(mark), stop: make(chan struct{}), done: make(chan struct{})}
	last, ok := lastPID()
	if !ok {
		close(w.done) // not Linux: nothing to watch
		return w
	}
	go w.run(last)
	return w
}

func (w *spawnWatch) run(last int) {
	defer close(w.done)
	t := time.NewTicker(5 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-w.stop:
			return
		case <-t.C:
		}
		cur, ok := lastPID()
		if !ok || cur == last {
			continue
		}
		// Process ids wrap around at pid_max: then look at the new ones
		// below the wrap only.
		from := last + 1
		if cur < last {
			from = 1
		}
		for pid := from; pid <= cur; pid++ {
			cmd, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
			if err == nil && bytes.Contains(cmd, w.mark) {
				w.mu.Lock()
				w.seen = append(w.seen, time.Now())
				w.mu.Unlock()
			}
		}
		last = cur
	}
}

// Stop ends the watch and returns how many marked processes started.
func (w *spawnWatch) Stop() int {
	select {
	case <-w.done:
	default:
		close(w.stop)
		<-w.done
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.seen)
}

// lastPID is the id of the process most recently started on the machine.
func lastPID() (int, bool) {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0, false
	}
	f := strings.Fields(string(b))
	if len(f) < 5 {
		return 0, false
	}
	pid, err := strconv.Atoi(f[4])
	return pid, err == nil
}
