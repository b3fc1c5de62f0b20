package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
	"github.com/onceler/onceler/internal/workerhooks"
)

// redisURL is the Redis result backend of the tests: database 9 of
// testkit.RedisAddr.
func redisURL(t *testing.T) string { return "redis://" + testkit.RedisAddr(t) + "/9" }

// TestReplayDemoRedis runs the replay suite on every demo task with the
// workers' results in Redis (--result-backend): every caller finds its
// result under its task id, with the same guarantees as TestReplayDemo.
// Its keys are its own random task ids, so it runs beside other tests.
func TestReplayDemoRedis(t *testing.T) {
	t.Parallel()
	url := redisURL(t)
	for _, tg := range demoTargets() {
		t.Run(tg.Task, func(t *testing.T) {
			tg.ResultBackend = url
			replay.Run(t, tg)
		})
	}
}

// TestChordsRedisKill: real Celery sends 20 chords of three demo.add parts
// and a demo.xsum body (on a queue of its own) with the Redis result
// backend; two onceler workers run the parts, one of them killed (its
// delivery runs again on another worker) before its first ack, or when it
// has completed a chord's header and not yet published its body: each body
// is published exactly once, with its parts' results, and gives its sum.
func TestChordsRedisKill(t *testing.T) {
	for _, at := range []string{workerhooks.BeforeAck, workerhooks.ChordJoined} {
		t.Run(at, func(t *testing.T) { chordsRedisKill(t, at) })
	}
}

func chordsRedisKill(t *testing.T, crashAt string) {
	url := redisURL(t)
	e := replay.NewEnv(t, replay.Config{Binary: oncelerBin, Command: []string{"worker", "--migrate"}, ResultBackend: url})
	if err := demo.Migrate(context.Background(), e.Pool); err != nil {
		t.Fatal(err)
	}
	bodyQ := e.Queue + "_bodies"
	t.Cleanup(func() {
		if conn, err := amqp091.Dial(e.AMQPURL); err == nil {
			if ch, err := conn.Channel(); err == nil {
				_, _ = ch.QueueDelete(bodyQ, false, false, false)
				_ = ch.ExchangeDelete(bodyQ, false, false)
			}
			_ = conn.Close()
		}
	})
	armed := e.StartWorker(replay.WorkerOptions{CrashAt: crashAt, CrashTask: demo.TaskAdd, Concurrency: 2, Prefetch: 4})
	e.StartWorker(replay.WorkerOptions{Concurrency: 2, Prefetch: 4})

	const chords = 20
	py := testenv.Python(t)
	spec, _ := json.Marshal(map[string]any{"broker": e.AMQPURL, "backend": url, "queue": e.Queue,
		"body_queue": bodyQ, "chords": chords, "parts": 3})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, py, filepath.Join("testdata", "chords.py"), string(spec)).Output()
	if err != nil {
		t.Fatalf("chords.py: %v", err)
	}
	var sent struct{ Bodies map[string]int64 }
	if err := json.Unmarshal(out, &sent); err != nil || len(sent.Bodies) != chords {
		t.Fatalf("chords.py output %q: %v", out, err)
	}
	if !testkit.Eventually(60*time.Second, armed.Exited) || !armed.Crashed() {
		t.Fatalf("the armed worker did not die at %s: %s", crashAt, armed.State())
	}
	e.StartWorker(replay.WorkerOptions{})
	if !testkit.Eventually(60*time.Second, func() bool { n, _ := e.QueueDepth(bodyQ); return n >= chords }) {
		n, err := e.QueueDepth(bodyQ)
		t.Fatalf("%d chord bodies published (err %v), want %d", n, err, chords)
	}
	// A second publish of a body would come with the redelivered part.
	time.Sleep(3 * time.Second)
	if n, err := e.QueueDepth(bodyQ); err != nil || n != chords {
		t.Fatalf("%d chord bodies published (err %v), want %d: once each", n, err, chords)
	}
	if n, err := e.QueueDepth(e.Queue); err != nil || n != 0 {
		t.Errorf("parts queue: %d left (err %v)", n, err)
	}
	// The bodies run, and each gives its chord's sum.
	e.StartWorker(replay.WorkerOptions{Env: []string{"ONCELER_QUEUES=" + e.Queue + "," + bodyQ}})
	ids := make([]string, 0, chords)
	for id := range sent.Bodies {
		ids = append(ids, id)
	}
	if !e.WaitReplies(ids, 1, 60*time.Second) {
		t.Fatal("not every chord body has a result")
	}
	for id, want := range sent.Bodies {
		r := e.Replies(id)
		if len(r) != 1 || r[0].Status != "SUCCESS" || string(r[0].Result) != fmt.Sprint(want) {
			t.Errorf("body %s: %v, want SUCCESS %d", id, r, want)
		}
	}
	if q, err := e.TakeQuarantined(); err != nil || len(q) != 0 {
		t.Errorf("quarantine: %v (err %v), want none", q, err)
	}
}
