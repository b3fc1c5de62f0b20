package tasks

import (
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceler/onceler/celeryproto"
)

// gathered returns the value of each series of reg, by metric name and
// task label (a histogram's count).
func gathered(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		for _, s := range mf.GetMetric() {
			task := ""
			for _, l := range s.GetLabel() {
				if l.GetName() == "task" {
					task = l.GetValue()
				}
			}
			switch {
			case s.GetCounter() != nil:
				got[mf.GetName()+"/"+task] = s.GetCounter().GetValue()
			case s.GetHistogram() != nil:
				got[mf.GetName()+"/"+task] = float64(s.GetHistogram().GetSampleCount())
			}
		}
	}
	return got
}

// Each task's cached children count in that task's series, which appear
// only once they counted something, from any number of goroutines.
func TestTaskMetricsCached(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	m, err := newMetrics(reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	w := &Worker{m: m}
	a, b := &handler{name: "a"}, &handler{name: "b"}
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 100 {
				w.taskMetricsOf(a).receivedOf(m, a.name).Inc()
				w.taskMetricsOf(a).succeededOf(m, a.name).Inc()
				w.taskMetricsOf(b).receivedOf(m, b.name).Inc()
				w.taskMetricsOf(b).secondsOf(m, b.name).Observe(0.001)
			}
		})
	}
	wg.Wait()
	if ta := w.taskMetricsOf(a); ta != w.taskMetricsOf(a) || ta == w.taskMetricsOf(b) {
		t.Error("taskMetricsOf: not one value per task")
	}
	got := gathered(t, reg)
	want := map[string]float64{
		"onceler_tasks_received_total/a":  800,
		"onceler_tasks_succeeded_total/a": 800,
		"onceler_tasks_received_total/b":  800,
		"onceler_task_duration_seconds/b": 800,
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %v, want %v", k, got[k], v)
		}
	}
	for _, k := range []string{"onceler_tasks_succeeded_total/b", "onceler_task_duration_seconds/a", "onceler_tasks_failed_total/a"} {
		if _, ok := got[k]; ok {
			t.Errorf("series %s exists before it counted anything", k)
		}
	}
}

// resultRepr's shortcuts give what decoding the result gives.
func TestResultReprShortcuts(t *testing.T) {
	t.Parallel()
	for _, res := range []string{"", "null", "true", "false"} {
		v, err := jsonValue([]byte(res))
		if err != nil {
			t.Fatal(err)
		}
		if got, want := resultRepr([]byte(res)), celeryproto.Repr(v); got != want {
			t.Errorf("resultRepr(%q) = %q, want %q", res, got, want)
		}
	}
}
