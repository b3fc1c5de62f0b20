package integration

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/testkit"
	"github.com/onceler/onceler/sqs"
)

// TestSQSSoak sends 10,000 messages (ONCELER_SOAK_TASKS to change) to an
// SQS queue (the local server), in batches over about a minute, across the
// Celery and plain targets of the SQS replay suite (half of them Celery
// messages in kombu's envelope, half plain; a sixth of them a second
// message for an operation sent before, as a producer whose call timed
// out), to two onceler worker --sqs processes, one of which is killed
// (kill -9) every few seconds and restarted. A killed worker's messages
// come back when their visibility timeouts (4 s) run out. At the end every
// operation has exactly one effect and a completed record, and the queue
// and its quarantine queue are empty. It prints a table of what it did.
// Runs with ONCELER_FAULT_TESTS=1.
func TestSQSSoak(t *testing.T) {
	faultTests(t)
	total := 10000
	if v, err := strconv.Atoi(os.Getenv("ONCELER_SOAK_TASKS")); err == nil && v > 0 {
		total = v
	}
	e := newSQSEnv(t, sqsEnvOptions{NoRedis: true})
	ctx := context.Background()
	opts := sqsWorkerOptions{Concurrency: 16, Prefetch: 32}
	workers := []*skWorker{e.startWorker(opts), e.startWorker(opts)}

	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 17))
	targets := sqsTargets()
	prefix := testkit.Name("sqss")
	var ops []*soakOp
	var msgs []sqs.Outgoing
	run := &sqsRun{}
	encode := func(o *soakOp) sqs.Outgoing {
		tg := targets[o.tg]
		if !tg.celery {
			m := run.plainMessage(tg.task, tg.args(o.key))
			return sqs.Outgoing{Body: m.Body, Attributes: m.Attributes}
		}
		// As kombu writes it; a new task id for each message.
		p, err := celeryproto.EncodeTask(&celeryproto.Message{Task: tg.task, ID: testkit.NewID(), Args: tg.args(o.key)},
			celeryproto.EncodeOptions{Protocol: 2})
		if err != nil {
			t.Fatal(err)
		}
		body, err := sqs.EncodeKombu(p, e.queue)
		if err != nil {
			t.Fatal(err)
		}
		return sqs.Outgoing{Body: body}
	}
	for len(msgs) < total {
		if len(ops) > 10 && rng.IntN(6) == 0 {
			o := ops[rng.IntN(len(ops))]
			o.sends++
			msgs = append(msgs, encode(o))
			continue
		}
		o := &soakOp{tg: rng.IntN(len(targets)), key: fmt.Sprintf("%s-%d", prefix, len(ops)), sends: 1}
		ops = append(ops, o)
		msgs = append(msgs, encode(o))
	}
	// Batches of about 500 messages, sent every 3 s.
	nb := max(1, (len(msgs)+499)/500)
	sendBatch := func(b int) int {
		part := msgs[b*len(msgs)/nb : (b+1)*len(msgs)/nb]
		var wg sync.WaitGroup
		var mu sync.Mutex
		sent := 0
		for g := range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := g; i < len(part); i += 8 {
					for attempt := 0; ; attempt++ {
						_, err := e.client.Send(ctx, e.queueURL, part[i])
						if err == nil {
							mu.Lock()
							sent++
							mu.Unlock()
							break
						}
						if attempt == 5 {
							t.Errorf("send: %v", err)
							break
						}
						time.Sleep(100 * time.Millisecond)
					}
				}
			}()
		}
		wg.Wait()
		return sent
	}

	d := &soakDriver{t: t, rng: rng, batches: nb, sent: "messages sent", send: sendBatch,
		startWorker: func() *skWorker { return e.startWorker(opts) },
		settled:     func() bool { return sqsSoakSettled(e, prefix, len(ops)) },
		count:       func() int { return soakCount(&e.queueEnv, prefix) },
		ops:         len(ops)}
	start, sentMsgs, kills := d.run(workers, 240*time.Second)
	drained := time.Since(start)
	if !sqsSoakSettled(e, prefix, len(ops)) {
		t.Errorf("after %s: messages or claims left (queue idle %v)", drained.Round(time.Second), e.idle())
	}
	if sentMsgs != len(msgs) {
		t.Errorf("sent %d messages, want %d", sentMsgs, len(msgs))
	}
	time.Sleep(500 * time.Millisecond)
	e.stopAll()

	sk := make([]skTarget, len(targets))
	for i, tg := range targets {
		sk[i] = tg.skTarget
	}
	per := soakOutcome(t, &e.queueEnv, sk, prefix, ops)
	if !e.idle() {
		t.Errorf("queue not empty at the end")
	}
	if n := e.depth(sqsQuarantineOf(e.queue)); n != 0 {
		t.Errorf("quarantine queue holds %d, want 0", n)
	}
	if n, err := e.store.StaleClaims(ctx); err != nil || n != 0 {
		t.Errorf("stale claims: %d (err %v), want 0", n, err)
	}
	var answered, takeovers int64
	stats, err := e.store.Repeats(ctx, start.Add(-time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	for _, st := range stats {
		answered += st.Duplicates
		takeovers += st.Takeovers
	}
	var b strings.Builder
	fmt.Fprintf(&b, "\nsqs soak: %d messages sent (%d batches; half Celery messages in kombu's envelope, half plain), %d operations,\n"+
		"%d messages for an operation sent before, through 2 workers in %s (%.0f messages/s)\n", sentMsgs, nb, len(ops), len(msgs)-len(ops),
		drained.Round(time.Second), float64(len(msgs))/drained.Seconds())
	fmt.Fprintf(&b, "faults: %d kill -9 (each restarted; a killed worker's messages come back past their 4 s visibility timeout)\n", kills)
	fmt.Fprintf(&b, "redeliveries: %d deliveries answered from the record (duplicates), %d claims taken over\n\n", answered, takeovers)
	soakReport(t, "sqs", b.String(), "msgs", sk, per)
	if kills == 0 {
		t.Error("sqs soak: no kill")
	}
}

// sqsSoakSettled reports whether the queue is empty and every one of the n
// operations under prefix has a record that is not claimed.
func sqsSoakSettled(e *sqsEnv, prefix string, n int) bool {
	return e.idle() && soakCount(&e.queueEnv, prefix) == n
}
