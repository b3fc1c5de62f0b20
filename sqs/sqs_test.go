package sqs

import (
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/onceler/onceler/celeryproto"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestDecodeKombuCelery: a message Celery 5.2.6 sent with broker_url
// "sqs://" (kombu's SQS transport, captured from the server) decodes to the
// Celery message it is.
func TestDecodeKombuCelery(t *testing.T) {
	b, err := os.ReadFile("testdata/kombu_celery526.txt")
	if err != nil {
		t.Fatal(err)
	}
	k, err := DecodeKombu(string(b))
	if err != nil {
		t.Fatal(err)
	}
	if k.RoutingKey != "manual1" || k.Delivery.ContentType != "application/json" || k.Delivery.DeliveryMode != 2 {
		t.Errorf("envelope read as %+v", k)
	}
	m, err := celeryproto.Decode(&k.Delivery)
	if err != nil {
		t.Fatal(err)
	}
	if m.Task != "demo.add" || m.ID != "e547f44f-0f6b-4275-b6b6-8d97638214aa" || len(m.Args) != 2 || m.Retries != 0 {
		t.Errorf("decoded %+v", m)
	}
}

// TestKombuRoundTrip: what EncodeKombu writes, DecodeKombu reads back as
// the same Celery message; plain bodies are not kombu's.
func TestKombuRoundTrip(t *testing.T) {
	p, err := celeryproto.EncodeTask(&celeryproto.Message{Task: "t.x", ID: "id-1", Args: []any{"a", int64(2)}, Retries: 3},
		celeryproto.EncodeOptions{Protocol: 2})
	if err != nil {
		t.Fatal(err)
	}
	body, err := EncodeKombu(p, "q1")
	if err != nil {
		t.Fatal(err)
	}
	k, err := DecodeKombu(body)
	if err != nil {
		t.Fatal(err)
	}
	m, err := celeryproto.Decode(&k.Delivery)
	if err != nil {
		t.Fatal(err)
	}
	if m.Task != "t.x" || m.ID != "id-1" || m.Retries != 3 || len(m.Args) != 2 || k.RoutingKey != "q1" {
		t.Errorf("round trip gave %+v (routing key %q)", m, k.RoutingKey)
	}
	for _, plain := range []string{`[1, 2]`, `{"a": 1}`, `not json`, `MTIz`, ``, `{"body": 1}`,
		`{"body": "<p>hi</p>", "properties": {"title": "Home"}}`,
		`{"body": "x", "content-type": "text/html", "properties": {"priority": 0}}`,
		`{"body": {"a": 1}, "content-type": "application/json", "properties": {"delivery_info": {}}}`} {
		if _, err := DecodeKombu(plain); err != ErrNotKombu {
			t.Errorf("DecodeKombu(%q) = %v, want ErrNotKombu", plain, err)
		}
	}
	if _, err := DecodeKombu(`{"body": "%%%", "content-type": "application/json", "properties": {"body_encoding": "base64", "delivery_info": {}}}`); err == nil || err == ErrNotKombu {
		t.Errorf("a broken envelope: %v, want an error other than ErrNotKombu", err)
	}
}

// TestDeadLetterName reads the dead-letter queue of a redrive policy, as
// SQS (an ARN) and goaws (a name) write it.
func TestDeadLetterName(t *testing.T) {
	for policy, want := range map[string]string{
		`{"deadLetterTargetArn":"arn:aws:sqs:us-east-1:123456789012:orders-dlq","maxReceiveCount":"5"}`: "orders-dlq",
		`{"maxReceiveCount": "5", "deadLetterTargetArn":"probe1-dlq"}`:                                  "probe1-dlq",
		`{"maxReceiveCount": "0", "deadLetterTargetArn":""}`:                                            "",
		``: "",
	} {
		if got := deadLetterName(policy); got != want {
			t.Errorf("deadLetterName(%s) = %q, want %q", policy, got, want)
		}
	}
}
