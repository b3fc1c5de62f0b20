package cmd

import "testing"

// TestSidekiqEdgeQueueWeightBounded: a queue's weight is expanded into
// that many entries of the fetch order (sidekiq.Config.Queues), copied and
// shuffled at every fetch: a weight of billions (a typo, a number meant
// for something else) makes the worker allocate tens of GB at its start
// and die out of memory, and one of millions burns a shuffle of millions
// of entries per job. --queues must refuse such a weight as a usage error
// (or the order be drawn without expanding it), as it refuses a weight
// that follows no queue. A negative weight, which Sidekiq's own -q refuses
// ([queue] * -1 raises), is not a weight of 1 either.
func TestSidekiqEdgeQueueWeightBounded(t *testing.T) {
	t.Parallel()
	for _, spec := range []string{"critical,4000000000,default,1", "critical,1000000,default", "critical,-1,default,2"} {
		if got, err := sidekiqQueues(spec); err == nil {
			t.Errorf("sidekiqQueues(%q) = %q, nil; want an error (a weight out of range)", spec, got)
		}
	}
}
