package main

import (
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// countingRegistry is the worker's metrics registry. It also keeps the
// collectors of the counters that say a delivery was answered, so that
// polling them (every few milliseconds during a run) costs little: a full
// Gather allocates enough to show up in the worker's own profile.
type countingRegistry struct {
	*prometheus.Registry
	watched []prometheus.Collector
}

// answeredCounters are the counters whose sum is the deliveries answered.
var answeredCounters = []string{
	`"onceler_tasks_succeeded_total"`, `"onceler_tasks_failed_total"`, `"onceler_duplicates_suppressed_total"`,
}

func newCountingRegistry() *countingRegistry {
	return &countingRegistry{Registry: prometheus.NewRegistry()}
}

// Register registers c and keeps it when it is one of answeredCounters. The
// worker registers its collectors before Run, so there is no race with
// answered.
func (r *countingRegistry) Register(c prometheus.Collector) error {
	if err := r.Registry.Register(c); err != nil {
		return err
	}
	descs := make(chan *prometheus.Desc, 16)
	go func() { c.Describe(descs); close(descs) }()
	keep := false
	for d := range descs {
		for _, name := range answeredCounters {
			if strings.Contains(d.String(), name) {
				keep = true
			}
		}
	}
	if keep {
		r.watched = append(r.watched, c)
	}
	return nil
}

// MustRegister registers the collectors, panicking on an error.
func (r *countingRegistry) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err)
		}
	}
}

// answered sums the watched counters.
func (r *countingRegistry) answered() int {
	ch := make(chan prometheus.Metric, 64)
	go func() {
		for _, c := range r.watched {
			c.Collect(ch)
		}
		close(ch)
	}()
	var sum float64
	var m dto.Metric
	for metric := range ch {
		m.Reset()
		if metric.Write(&m) == nil && m.GetCounter() != nil {
			sum += m.GetCounter().GetValue()
		}
	}
	return int(sum)
}
