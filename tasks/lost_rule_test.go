package tasks

import (
	"testing"
	"time"

	"github.com/onceler/onceler/celeryproto"
)

// ruleDelivery is a delivery with what redeliveryAnswers looks at.
type ruleDelivery struct {
	delivery
	w        celeryproto.Delivery
	n, limit int
}

func (d *ruleDelivery) wire() *celeryproto.Delivery { return &d.w }
func (d *ruleDelivery) deliveryCount() int          { return d.n }
func (d *ruleDelivery) deliveryLimit() int          { return d.limit }

// TestRedeliveryAnswersRule: a lost delivery's answer is left to its
// redelivery only for a completed record, a persistent message without TTL
// or expires, not the queue's last delivery nor past MaxAttempts.
func TestRedeliveryAnswersRule(t *testing.T) {
	w := &Worker{cfg: Config{MaxAttempts: 5}}
	for _, c := range []struct {
		name      string
		completed bool
		mode      uint8
		ttl       string
		expires   bool
		n, limit  int
		leave     bool
	}{
		{name: "completed, persistent", completed: true, mode: 2, leave: true},
		{name: "not completed", mode: 2},
		{name: "transient", completed: true, mode: 1},
		{name: "mode unset", completed: true},
		{name: "ttl", completed: true, mode: 2, ttl: "4000"},
		{name: "expires", completed: true, mode: 2, expires: true},
		{name: "redelivery is the last", completed: true, mode: 2, n: 0, limit: 1},
		{name: "this delivery is the last", completed: true, mode: 2, n: 3, limit: 3},
		{name: "below the limit", completed: true, mode: 2, n: 0, limit: 3, leave: true},
		{name: "redelivery past MaxAttempts", completed: true, mode: 2, n: 5},
		{name: "redelivery at MaxAttempts", completed: true, mode: 2, n: 4, leave: true},
	} {
		msg := &celeryproto.Message{}
		if c.expires {
			msg.Expires = time.Now().Add(time.Hour)
		}
		j := &job{d: &ruleDelivery{w: celeryproto.Delivery{DeliveryMode: c.mode, Expiration: c.ttl}, n: c.n, limit: c.limit}, msg: msg}
		why := w.redeliveryAnswers(j, c.completed)
		if (why == "") != c.leave {
			t.Errorf("%s: %q, want left to the redelivery %v", c.name, why, c.leave)
		}
	}
}
