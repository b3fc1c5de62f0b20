package cmd

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

func listQuarantine(t *testing.T, s *stack) []quarantined {
	t.Helper()
	r := runBin(t, s.env, "quarantine", "list", "--json")
	if r.code != 0 {
		t.Fatalf("quarantine list: %s", r.stderr)
	}
	var ms []quarantined
	if err := json.Unmarshal([]byte(r.stdout), &ms); err != nil {
		t.Fatalf("quarantine list --json: %v\n%s", err, r.stdout)
	}
	return ms
}

func TestQuarantineListRequeueDrop(t *testing.T) {
	t.Parallel()
	s := newStack(t)
	r := runBin(t, s.env, "quarantine", "list")
	if r.code != 0 || !strings.Contains(r.stdout, "no queue "+s.queue+".quarantine") {
		t.Fatalf("list before any quarantine: exit %d %q %q", r.code, r.stdout, r.stderr)
	}

	w := startWorker(t, s.env)
	sender := s.sendTasks(t, 60*time.Second, call{"demo.nope", []any{1}}, call{"demo.add", []any{1}}) // y missing: bad arguments
	ids, replies := sender.replies(90 * time.Second)
	if len(replies) != 2 || replies[0].Error != "NotRegistered" || replies[1].Error == "" {
		t.Fatalf("replies %+v, want NotRegistered and a failure", replies)
	}
	w.stop()

	ms := listQuarantine(t, s)
	reasons := map[string]string{}
	for _, m := range ms {
		reasons[m.TaskID] = m.Reason
		if m.Queue != s.queue || m.QuarantinedAt == "" || m.Detail == "" {
			t.Fatalf("quarantined message without origin, time or detail: %+v", m)
		}
	}
	if len(ms) != 2 || reasons[ids[0]] != "unknown_task" || reasons[ids[1]] != "bad_arguments" {
		t.Fatalf("quarantine list = %+v (ids %v)", ms, ids)
	}
	r = runBin(t, s.env, "quarantine", "list")
	if !strings.Contains(r.stdout, ids[0]+"  demo.nope  unknown_task") || !strings.Contains(r.stdout, "2 message(s) in "+s.queue+".quarantine") {
		t.Fatalf("quarantine list table:\n%s", r.stdout)
	}
	if n := len(listQuarantine(t, s)); n != 2 {
		t.Fatalf("listing removed messages: %d left", n)
	}

	// Requeue the unknown task: it goes back to its queue, without the
	// quarantine headers.
	r = runBin(t, s.env, "quarantine", "requeue", ids[0])
	if r.code != 0 || !strings.Contains(r.stdout, "requeued "+ids[0]+" (demo.nope, unknown_task)") {
		t.Fatalf("requeue: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if n := testkit.QueueDepth(t, testenv.AMQPURL(t), s.queue); n != 1 {
		t.Fatalf("queue %s holds %d messages after requeue, want 1", s.queue, n)
	}
	if ms := listQuarantine(t, s); len(ms) != 1 || ms[0].TaskID != ids[1] {
		t.Fatalf("after requeue: %+v", ms)
	}
	// A worker still does not know the task: quarantined again.
	w = startWorker(t, s.env)
	deadline := time.Now().Add(30 * time.Second)
	for len(listQuarantine(t, s)) != 2 {
		if time.Now().After(deadline) {
			t.Fatal("requeued message was not quarantined again")
		}
		time.Sleep(200 * time.Millisecond)
	}
	w.stop()

	r = runBin(t, s.env, "quarantine", "drop", "--all", "--reason", "bad_arguments")
	if r.code != 0 || !strings.Contains(r.stdout, "dropped 1 of 2 message(s)") {
		t.Fatalf("drop --reason: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if ms := listQuarantine(t, s); len(ms) != 1 || ms[0].Reason != "unknown_task" {
		t.Fatalf("after drop: %+v", ms)
	}
	r = runBin(t, s.env, "quarantine", "list", "--limit", "1")
	if r.code != 0 || !strings.Contains(r.stdout, "1 message(s) among the first 1 in "+s.queue+".quarantine (--limit: there may be more)") {
		t.Fatalf("list --limit 1: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	r = runBin(t, s.env, "quarantine", "drop", "no-such-id")
	if line := oneLineError(t, r, 1); !strings.Contains(line, "not found in "+s.queue+".quarantine: no-such-id") {
		t.Fatalf("drop of a missing id: %q", line)
	}
	r = runBin(t, s.env, "quarantine", "drop", "--all")
	if r.code != 0 || len(listQuarantine(t, s)) != 0 {
		t.Fatalf("drop --all: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
}

// quarantine takes --queues as the worker does, --queue as its alias, and
// ONCELER_QUEUES from the environment.
func TestQuarantineTakesQueues(t *testing.T) {
	t.Parallel()
	var got string
	c := quarantineCommand()
	c.setup = func(a *app, fs *flagSet) func(_ context.Context, args []string) error {
		fs.String(&got, "queues", "LIST", "celery", "")
		fs.Alias("queue", "queues")
		return func(context.Context, []string) error { return nil }
	}
	for _, tc := range []struct {
		args []string
		env  map[string]string
		want string
	}{
		{nil, nil, "celery"},
		{[]string{"--queues", "a,b"}, nil, "a,b"},
		{[]string{"--queue", "a"}, nil, "a"},
		{nil, map[string]string{"ONCELER_QUEUES": "x,y"}, "x,y"},
		{nil, map[string]string{"ONCELER_QUEUE": "x"}, "x"},
		{nil, map[string]string{"ONCELER_QUEUE": "x", "ONCELER_QUEUES": "y"}, "y"},
		{[]string{"--queue", "z"}, map[string]string{"ONCELER_QUEUES": "y"}, "z"},
	} {
		got = ""
		a := &app{stdout: &strings.Builder{}, stderr: &strings.Builder{}, getenv: func(k string) string { return tc.env[k] }}
		if err := a.runCommand(context.Background(), c, tc.args); err != nil || got != tc.want {
			t.Errorf("%v %v: queues %q (err %v), want %q", tc.args, tc.env, got, err, tc.want)
		}
	}
	r := runBin(t, nil, "quarantine", "list", "--queues", " , ")
	if line := oneLineError(t, r, 2); !strings.Contains(line, "--queues names no queue") {
		t.Errorf("empty --queues: %q", line)
	}
}
