package control

import (
	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/tasks"
)

// FromTasks adapts a *tasks.Worker to Worker.
func FromTasks(w *tasks.Worker) Worker { return tasksWorker{w} }

type tasksWorker struct{ w *tasks.Worker }

func (t tasksWorker) Registered() []string                { return t.w.Registered() }
func (t tasksWorker) Active() []TaskInfo                  { return fromTaskInfos(t.w.Active()) }
func (t tasksWorker) Reserved() []TaskInfo                { return fromTaskInfos(t.w.Reserved()) }
func (t tasksWorker) Scheduled() []TaskInfo               { return fromTaskInfos(t.w.Scheduled()) }
func (t tasksWorker) Revoke(ids []string, terminate bool) { t.w.Revoke(ids, terminate) }
func (t tasksWorker) Stats() map[string]any               { return t.w.Stats() }
func (t tasksWorker) Queues() []amqp.QueueSpec            { return t.w.Queues() }

func fromTaskInfos(in []tasks.TaskInfo) []TaskInfo {
	out := make([]TaskInfo, len(in))
	for i, ti := range in {
		out[i] = TaskInfo{
			ID: ti.ID, Name: ti.Name, ArgsRepr: ti.ArgsRepr, KwargsRepr: ti.KwargsRepr,
			Started: ti.Started, Acknowledged: ti.Acknowledged,
			Exchange: ti.Exchange, RoutingKey: ti.RoutingKey, Priority: ti.Priority,
			Redelivered: ti.Redelivered, ETA: ti.ETA,
		}
	}
	return out
}

// The worker hands task events to the controller as values.
var _ tasks.TaskEventObserver = (*Controller)(nil)
