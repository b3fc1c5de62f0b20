package integration

import (
	"context"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// pyPublishHeaderShapes publishes, with py-amqp (Celery's own client), one
// demo.add task message per header shape the AMQP library could not read:
// 64-bit integers of field type L, 9,000 headers, a 9,000-element array, a
// table nested 40 deep. argv: broker URL, queue, reply_to, then the task
// ids, one per shape.
const pyPublishHeaderShapes = `
import sys, urllib.parse, amqp
u = urllib.parse.urlparse(sys.argv[1])
queue, reply_to, ids = sys.argv[2], sys.argv[3], sys.argv[4:]
deep = {"leaf": 1}
for _ in range(40):
    deep = {"d": deep}
shapes = [
    {"big": 2**31, "nested": {"big": 2**63 - 1}},
    dict(("h%d" % i, None) for i in range(9000)),
    {"a": [None] * 9000},
    {"deep": deep},
]
vhost = urllib.parse.unquote(u.path[1:]) or "/"
with amqp.Connection("%s:%d" % (u.hostname, u.port or 5672), userid=u.username or "guest",
                     password=u.password or "guest", virtual_host=vhost) as conn:
    ch = conn.channel()
    for tid, extra in zip(ids, shapes):
        headers = {"lang": "py", "task": "demo.add", "id": tid, "root_id": tid}
        headers.update(extra)
        msg = amqp.Message(b'[[1, 2], {}, {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]',
                           content_type="application/json", content_encoding="utf-8",
                           correlation_id=tid, reply_to=reply_to, application_headers=headers)
        ch.basic_publish(msg, exchange="", routing_key=queue)
`

// TestHostileInputs publishes, as bytes through real AMQP clients, the
// small hostile messages of docs/limits.md and docs/refused-publishes.md
// to a running `onceler worker --migrate` with a memory budget: header shapes
// the AMQP library could not read, workflow steps and replies the broker
// refuses, a quarantine copy larger than a frame, a YAML body of two
// documents, a producer's x-delivery-count on a classic queue. After each,
// the hostile message is answered at most once (and quarantined when it is
// refused), it ran at most once, a normal task is answered within seconds,
// the consuming connection was kept, and the worker's peak memory stays
// under the budget plus a margin.
func TestHostileInputs(t *testing.T) {
	py := testenv.Python(t)
	e := demoEnv(t)
	w := e.StartWorker(replay.WorkerOptions{Concurrency: 4, Prefetch: 16,
		Env: []string{"ONCELER_MEMORY_BUDGET=" + strconv.Itoa(hostileBudget), "ONCELER_LOG_LEVEL=warn"}})
	guardMemory(t, w)
	ctx := context.Background()
	body := func(args string, embed string) []byte {
		if embed == "" {
			embed = `{"callbacks": null, "errbacks": null, "chain": null, "chord": null}`
		}
		return []byte(`[` + args + `, {}, ` + embed + `]`)
	}
	type want struct {
		answer     string // the status of the one answer; "" for none
		quarantine string // the quarantine reason; "" for none
	}
	cases := []struct {
		name string
		send func() []string // publishes, returns the task ids
		want want
	}{
		{"header shapes py-amqp writes and the library refused", func() []string {
			ids := []string{testkit.NewID(), testkit.NewID(), testkit.NewID(), testkit.NewID()}
			cmd := exec.Command(py, append([]string{"-c", pyPublishHeaderShapes, e.AMQPURL, e.Queue, e.ReplyTo}, ids...)...)
			cmd.Dir = t.TempDir()
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Fatalf("py-amqp: %v: %s", err, out)
			}
			return ids
		}, want{}}, // checked below: the first runs, the others are refused
		{"chain step to a missing exchange", func() []string {
			p := rawTask(e, demo.TaskAdd, celeryproto.ContentTypeJSON, body(`[1, 2]`,
				`{"chain": [{"task": "demo.add", "args": [1], "kwargs": {}, "options": {"exchange": "onceler-no-such-exchange", "routing_key": "x"}, "subtask_type": null, "immutable": false}]}`), nil)
			p.ContentEncoding = "utf-8"
			must(t, e.PublishRaw(ctx, "", e.Queue, p))
			return []string{p.CorrelationID}
		}, want{"FAILURE", "publish_refused"}},
		{"link to amq.foo", func() []string {
			p := rawTask(e, demo.TaskAdd, celeryproto.ContentTypeJSON, body(`[1, 2]`,
				`{"callbacks": [{"task": "demo.add", "args": [1], "kwargs": {}, "options": {"exchange": "amq.foo", "routing_key": "x"}, "subtask_type": null, "immutable": false}]}`), nil)
			p.ContentEncoding = "utf-8"
			must(t, e.PublishRaw(ctx, "", e.Queue, p))
			return []string{p.CorrelationID}
		}, want{"FAILURE", "publish_refused"}},
		{"reply_to amq.rabbitmq.reply-to.<garbage>", func() []string {
			p := rawTask(e, demo.TaskAdd, celeryproto.ContentTypeJSON, body(`[1, 2]`, ""), nil)
			p.ContentEncoding, p.ReplyTo = "utf-8", "amq.rabbitmq.reply-to.g2dkAA.x"
			must(t, e.PublishRaw(ctx, "", e.Queue, p))
			return []string{p.CorrelationID}
		}, want{}}, // nobody to answer; it must not stall the worker
		{"unknown task name of 60 KB and a header of 68 KB", func() []string {
			p := rawTask(e, "t."+strings.Repeat("x", 60_000), celeryproto.ContentTypeJSON, body(`[1, 2]`, ""),
				map[string]any{"x-pad": strings.Repeat("p", 68_000)})
			p.ContentEncoding = "utf-8"
			must(t, e.PublishRaw(ctx, "", e.Queue, p))
			return []string{p.CorrelationID}
		}, want{"FAILURE", "unknown_task"}},
		{"YAML body of two documents", func() []string {
			p := rawTask(e, demo.TaskAdd, celeryproto.ContentTypeYAML, []byte("- [1, 2]\n- {}\n- {}\n---\n- [3, 4]\n- {}\n- {}\n"), nil)
			p.ContentEncoding = "utf-8"
			must(t, e.PublishRaw(ctx, "", e.Queue, p))
			return []string{p.CorrelationID}
		}, want{"FAILURE", "undecodable"}},
		{"a producer's x-delivery-count 99 on a classic queue", func() []string {
			p := rawTask(e, demo.TaskAdd, celeryproto.ContentTypeJSON, body(`[1, 2]`, ""), map[string]any{"x-delivery-count": int64(99)})
			p.ContentEncoding = "utf-8"
			must(t, e.PublishRaw(ctx, "", e.Queue, p))
			return []string{p.CorrelationID}
		}, want{"SUCCESS", ""}},
	}
	for _, c := range cases {
		ids := c.send()
		time.Sleep(3 * time.Second) // long enough for a loop to show itself
		q, err := e.TakeQuarantined()
		if err != nil {
			t.Fatalf("%s: quarantine: %v", c.name, err)
		}
		if c.name == cases[0].name {
			// L integers read: the task runs; the three shapes it could not
			// read: refused as undecodable, answered DecodeError.
			e.WaitReplies(ids, 1, 10*time.Second)
			if r := e.Replies(ids[0]); len(r) != 1 || r[0].Status != "SUCCESS" {
				t.Errorf("%s: L integers: answered %v, want one SUCCESS", c.name, r)
			}
			for _, id := range ids[1:] {
				if r := e.Replies(id); len(r) != 1 || r[0].ExcType != "DecodeError" {
					t.Errorf("%s: answered %v, want one DecodeError", c.name, r)
				}
			}
			if len(q) != 3 {
				t.Errorf("%s: %d quarantined, want 3", c.name, len(q))
			}
		} else {
			if c.want.answer != "" {
				e.WaitReplies(ids, 1, 10*time.Second)
			}
			for _, id := range ids {
				r := e.Replies(id)
				switch {
				case c.want.answer == "" && len(r) > 1, c.want.answer != "" && (len(r) != 1 || r[0].Status != c.want.answer):
					t.Errorf("%s: answered %v, want %q once", c.name, r, c.want.answer)
				}
			}
			reasons := make([]string, 0, len(q))
			for _, m := range q {
				reasons = append(reasons, m.Reason)
			}
			if wantN := map[bool]int{true: 1, false: 0}[c.want.quarantine != ""]; len(q) != wantN || (wantN == 1 && q[0].Reason != c.want.quarantine) {
				t.Errorf("%s: quarantined %v, want %q", c.name, reasons, c.want.quarantine)
			}
		}
		stillServing(t, e, w, c.name)
	}
	if n, err := e.QueueDepth(e.Queue); err != nil || n != 0 {
		t.Errorf("queue: %d messages left (%v)", n, err)
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
