package amqp

import (
	"testing"

	amqp091 "github.com/onceler/onceler/internal/amqp091"
)

// TestAccessRefusalOfTopicNamesUserAndVhost: RabbitMQ's 403 for a topic
// permission (set_topic_permissions) names the routing key, the
// exchange, the vhost and the user; the AccessError must keep the user
// and the vhost (the start-up line otherwise names an empty user and vhost).
// The text is RabbitMQ 3.10's answer to the start-up write check.
func TestAccessRefusalOfTopicNamesUserAndVhost(t *testing.T) {
	t.Parallel()
	err := &amqp091.Error{Code: amqp091.AccessRefused,
		Reason: "ACCESS_REFUSED - access to topic 'onceler.access-check' in exchange 'celeryev' in vhost 'v1' refused for user 'u1'"}
	ae := AccessRefusal("publish", err)
	if ae == nil {
		t.Fatal("not an access refusal")
	}
	if ae.User != "u1" || ae.VHost != "v1" {
		t.Fatalf("user %q vhost %q, want u1 and v1: %s", ae.User, ae.VHost, ae.Error())
	}
}

// TestAccessRefusalOfDeclareQueueOnDeadLetterExchange: a queue.declare
// with x-dead-letter-exchange that RabbitMQ refuses naming an exchange is
// its check of write on the dead-letter exchange (configure is checked on
// the queue only); the AccessError must name write, not configure.
func TestAccessRefusalOfDeclareQueueOnDeadLetterExchange(t *testing.T) {
	t.Parallel()
	err := &amqp091.Error{Code: amqp091.AccessRefused,
		Reason: "ACCESS_REFUSED - access to exchange 'dlx' in vhost 'v1' refused for user 'u1'"}
	ae := AccessRefusal("declare queue", err)
	if ae == nil {
		t.Fatal("not an access refusal")
	}
	if ae.Permission != "write" {
		t.Fatalf("permission %q, want write: %s", ae.Permission, ae.Error())
	}
}
