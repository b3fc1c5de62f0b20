package control

import (
	"os"
	"time"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
)

// Worker is what the controller needs from the task worker: *tasks.Worker
// is one (it runs a Controller of its own unless tasks.Config.NoControl is
// set); tests may provide their own.
type Worker interface {
	// Registered lists the registered task names.
	Registered() []string
	// Active lists the tasks running now.
	Active() []TaskInfo
	// Reserved lists the tasks received and waiting for a task slot.
	Reserved() []TaskInfo
	// Scheduled lists the tasks held until their ETA.
	Scheduled() []TaskInfo
	// Revoke marks ids revoked: they get REVOKED instead of running when
	// received or before they run; with terminate, a running one has its
	// context cancelled.
	Revoke(ids []string, terminate bool)
	// Stats returns counters for inspect stats; "total" maps task names to
	// the number of tasks processed.
	Stats() map[string]any
	// Queues lists the queues consumed, for inspect active_queues: as found
	// on the broker, with their arguments (amqp.Consumer.Queues).
	Queues() []amqp.QueueSpec
}

// TaskInfo describes a task the worker holds, for inspect active, reserved
// and scheduled.
type TaskInfo struct {
	ID, Name string
	// ArgsRepr and KwargsRepr are what the producer put in the argsrepr and
	// kwargsrepr headers (they may hold secrets); inspect shows these rather
	// than argument values.
	ArgsRepr, KwargsRepr string
	// Started is when the task started running (zero if not yet).
	Started time.Time
	// Acknowledged is whether the message was acknowledged (a onceler
	// worker acknowledges late: never while it holds the task).
	Acknowledged bool
	// Queue, Exchange, RoutingKey, Priority and Redelivered are the
	// delivery info.
	Queue, Exchange, RoutingKey string
	Priority                    uint8
	Redelivered                 bool
	// ETA is when a scheduled task is due (zero if it has none).
	ETA time.Time
	// Hostname is the node name of the worker holding the task.
	Hostname string
}

// request returns the task as Celery's Request.info() does.
func (t TaskInfo) request(node string) map[string]any {
	var start any
	if !t.Started.IsZero() {
		start = float64(t.Started.UnixNano()) / 1e9
	}
	return map[string]any{
		"id":           t.ID,
		"name":         t.Name,
		"args":         t.ArgsRepr,
		"kwargs":       t.KwargsRepr,
		"type":         t.Name,
		"hostname":     node,
		"time_start":   start,
		"acknowledged": t.Acknowledged,
		"delivery_info": map[string]any{
			"exchange":    t.Exchange,
			"routing_key": t.RoutingKey,
			"priority":    int(t.Priority),
			"redelivered": t.Redelivered,
		},
		"worker_pid": os.Getpid(),
	}
}

// scheduled returns the task as Celery's inspect scheduled lists it.
func (t TaskInfo) scheduled(node string) map[string]any {
	var eta any
	if !t.ETA.IsZero() {
		eta = celeryproto.FormatTime(t.ETA)
	}
	return map[string]any{"eta": eta, "priority": int(t.Priority), "request": t.request(node)}
}

func requests(ts []TaskInfo, node string) []any {
	out := make([]any, 0, len(ts))
	for _, t := range ts {
		out = append(out, t.request(node))
	}
	return out
}
