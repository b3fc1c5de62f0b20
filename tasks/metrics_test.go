package tasks

import (
	"context"
	"errors"
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"time"

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

// TestLapsedClaimsCountedOnceASecond: scrapes, however many and however
// close, ask the record for the lapsed claims at most once per
// lapsedCacheTTL, one at a time, and a failed count reads NaN until the
// next one.
func TestLapsedClaimsCountedOnceASecond(t *testing.T) {
	t.Parallel()
	var calls, running, overlap atomic.Int64
	fail := atomic.Bool{}
	c := &cachedCount{ttl: time.Second, count: func(context.Context) (int64, error) {
		if running.Add(1) > 1 {
			overlap.Add(1)
		}
		defer running.Add(-1)
		time.Sleep(20 * time.Millisecond)
		if fail.Load() {
			return 0, errors.New("record away")
		}
		return calls.Add(1), nil
	}}
	var wg sync.WaitGroup
	for range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if v := c.value(); v != 1 {
				t.Errorf("value %v, want 1 (the first count)", v)
			}
		}()
	}
	wg.Wait()
	if calls.Load() != 1 || overlap.Load() != 0 {
		t.Fatalf("%d counts (%d overlapping) for 50 scrapes within the TTL, want 1", calls.Load(), overlap.Load())
	}
	time.Sleep(1100 * time.Millisecond)
	if v := c.value(); v != 2 {
		t.Fatalf("after the TTL: %v, want 2 (counted again)", v)
	}
	fail.Store(true)
	time.Sleep(1100 * time.Millisecond)
	if v := c.value(); !math.IsNaN(v) {
		t.Fatalf("failed count: %v, want NaN", v)
	}
}
