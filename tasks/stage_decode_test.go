package tasks

import (
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/testkit"
)

// TestUndecodableCallerAnswered: a body that cannot be read, or pickle, is
// quarantined unread, and a caller named by the message's id header and
// reply_to hears why (ContentDisallowed or DecodeError, as kombu raises).
func TestUndecodableCallerAnswered(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.start(testRegistry(t, &effects{}), e.config())
	replyTo, replies := e.replyQueue()
	e.publishRaw(&celeryproto.Publishing{ContentType: "application/x-python-serialize", ContentEncoding: "binary",
		Body: []byte("\x80\x04\x95garbage."), Headers: map[string]any{"task": "t.add", "id": taskID(1), "lang": "py"},
		ReplyTo: replyTo, CorrelationID: taskID(1)})
	e.publishRaw(&celeryproto.Publishing{ContentType: "application/json", ContentEncoding: "utf-8",
		Body: []byte("{not json"), Headers: map[string]any{"task": "t.add", "id": taskID(2), "lang": "py"},
		ReplyTo: replyTo, CorrelationID: taskID(2)})
	res := results(t, replies, 2, 10*time.Second)
	for id, want := range map[string]string{taskID(1): "ContentDisallowed", taskID(2): "DecodeError"} {
		r := res[id]
		if len(r) != 1 || r[0]["status"] != "FAILURE" {
			t.Errorf("%s: answered %v, want one FAILURE %s", id, r, want)
			continue
		}
		if exc, _ := r[0]["result"].(map[string]any); exc["exc_type"] != want || exc["exc_module"] != "kombu.exceptions" {
			t.Errorf("%s: %v, want kombu.exceptions.%s", id, exc, want)
		}
	}
	// The same from a real Celery caller that sends pickle.
	if r := e.python(2, "pickle", pyCall{Task: "t.add", Args: []any{1, 2}}); r[0].ExcType != "ContentDisallowed" || r[0].ExcModule != "kombu.exceptions" {
		t.Errorf("pickle from Celery: %+v, want kombu.exceptions.ContentDisallowed", r[0])
	}
	var got []amqp091.Delivery
	testkit.WaitFor(t, "all three in quarantine", 10*time.Second, func() bool {
		got = append(got, e.quarantined()...)
		return len(got) >= 3
	})
	for _, d := range got {
		if d.Headers[HeaderReason] != ReasonUndecodable {
			t.Errorf("quarantined %v as %v", d.Headers["id"], d.Headers[HeaderReason])
		}
	}
}
