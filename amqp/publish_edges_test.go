package amqp

import (
	"context"
	"testing"
	"time"
)

// TestPublishTimeoutBlockEndingBeforeTheBound: a block that starts after the
// publish and ends shortly before PublishOptions.Timeout would have run out
// (an alarm of 29 s within the worker's 30 s bound) must not count against
// the bound: PublishOptions.Timeout "does not run while the block lasts",
// so the publish has the unblocked time it had left (here 0.7 of the bound)
// to get the confirm the broker now owes, behind the backlog the alarm
// built up. withTimeout looks at the block only when the timer fires: the
// bound runs through the block and ends 0.05 of it after the alarm clears,
// and the publish is given up and sent again as a second copy.
func TestPublishTimeoutBlockEndingBeforeTheBound(t *testing.T) {
	p := NewPublisher(Config{URL: "amqp://127.0.0.1:1/"})
	s := &pubSession{dead: make(chan struct{})}
	p.cur = s
	const d = 400 * time.Millisecond

	start := time.Now()
	ctx, stop := p.withTimeout(context.Background(), d)
	defer stop()
	time.Sleep(d / 10)
	s.setBlocked(true) // the alarm: 0.1 d after the publish
	time.Sleep(d * 85 / 100)
	s.setBlocked(false) // cleared at 0.95 d: 0.1 d of unblocked time spent
	unblocked := time.Now()
	select {
	case <-ctx.Done():
		t.Fatalf("publish bound ran out %s after the block ended (%s after the publish, %s of it blocked), "+
			"want no end before %s of unblocked time: %v",
			time.Since(unblocked).Round(time.Millisecond), time.Since(start).Round(time.Millisecond),
			unblocked.Sub(start.Add(d/10)).Round(time.Millisecond), d, context.Cause(ctx))
	case <-time.After(d / 2):
	}
}
