package control

import (
	"errors"
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
	// Args and Kwargs are the decoded arguments (nil when not decoded):
	// inspect active, reserved, scheduled and query_task give them as
	// values, as Celery's Request.info() does.
	Args   []any
	Kwargs map[string]any
	// ArgsRepr and KwargsRepr are what the producer put in the argsrepr and
	// kwargsrepr headers (they may hold secrets): what inspect gives with
	// safe=True, and instead of values not decoded.
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

// request returns the task as Celery's Request.info(safe) does: args and
// kwargs as values, or with safe as their reprs.
func (t TaskInfo) request(node string, safe bool) map[string]any {
	var start any
	if !t.Started.IsZero() {
		start = float64(t.Started.UnixNano()) / 1e9
	}
	var args, kwargs any = t.ArgsRepr, t.KwargsRepr
	if !safe && (t.Args != nil || t.Kwargs != nil) {
		args, kwargs = argValues(t.Args), kwargValues(t.Kwargs)
	} else if safe {
		if args == "" && t.Args != nil {
			args = celeryproto.ArgsRepr(t.Args)
		}
		if kwargs == "" && t.Kwargs != nil {
			kwargs = celeryproto.Repr(t.Kwargs)
		}
	}
	return map[string]any{
		"id":           t.ID,
		"name":         t.Name,
		"args":         args,
		"kwargs":       kwargs,
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
func (t TaskInfo) scheduled(node string, safe bool) map[string]any {
	var eta any
	if !t.ETA.IsZero() {
		eta = celeryproto.FormatTime(t.ETA)
	}
	return map[string]any{"eta": eta, "priority": int(t.Priority), "request": t.request(node, safe)}
}

func requests(ts []TaskInfo, node string, safe bool) []any {
	out := make([]any, 0, len(ts))
	for _, t := range ts {
		out = append(out, t.request(node, safe))
	}
	return out
}

// argValues and kwargValues give empty arguments as [] and {}, as Celery
// does, never null.
func argValues(a []any) []any {
	if a == nil {
		return []any{}
	}
	return a
}

func kwargValues(k map[string]any) map[string]any {
	if k == nil {
		return map[string]any{}
	}
	return k
}

// Tuner is what a Worker may also implement to take Celery's run-time
// commands: rate_limit, time_limit, add_consumer, cancel_consumer,
// pool_grow, pool_shrink, autoscale and conf. *tasks.Worker is one. A
// Worker without it answers them with an error.
type Tuner interface {
	// SetRateLimit sets task's rate limit, in Celery's syntax ("10/m";
	// "" or "0": none). An unknown task is ErrUnknownTask.
	SetRateLimit(task, rate string) error
	// SetTimeLimit sets task's soft and hard time limits (0: none, the
	// message's apply). An unknown task is ErrUnknownTask.
	SetTimeLimit(task string, soft, hard time.Duration) error
	// AddQueue starts consuming q (declared as a configured queue is);
	// consuming it already is no error.
	AddQueue(q amqp.QueueSpec) error
	// CancelQueue stops consuming the queue named; one not consumed is no
	// error.
	CancelQueue(name string) error
	// PoolSize returns the number of task slots; SetPoolSize sets it (at
	// least 1) and returns the number now in force.
	PoolSize() int
	SetPoolSize(n int) int
	// Settings returns the worker's settings under Celery's names: those
	// that differ from Celery's defaults, or with withDefaults all of them.
	// Secrets are redacted.
	Settings(withDefaults bool) map[string]any
}

// ErrUnknownTask is what a Tuner returns (wrapped) for a task name it does
// not serve.
var ErrUnknownTask = errors.New("unknown task")
