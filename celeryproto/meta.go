package celeryproto

import (
	"fmt"
	"time"
)

// MetaRequest is what a key-value result backend keeps of the request
// beside a result, as Celery's Backend._get_result_meta takes it.
type MetaRequest struct {
	// GroupID and ParentID are stored when set (group_id, parent_id).
	GroupID, ParentID string
	// Extended adds name, args, kwargs, worker, retries and queue, as
	// Celery's result_extended.
	Extended bool
	Name     string
	Args     []any
	Kwargs   map[string]any
	Worker   string
	Retries  int
	// Queue is the routing key the message came by (delivery_info
	// routing_key).
	Queue string
}

// readyStates are Celery's READY_STATES: their meta has a date_done.
func readyState(s State) bool {
	return s == StateSuccess || s == StateFailure || s == StateRevoked
}

// FormatDateDone writes t as Celery's date_done: datetime.utcnow()
// .isoformat() (UTC, no offset, microseconds when not zero).
func FormatDateDone(t time.Time) string {
	t = t.UTC()
	if t.Nanosecond()/1000 == 0 {
		return t.Format("2006-01-02T15:04:05")
	}
	return t.Format("2006-01-02T15:04:05.000000")
}

// EncodeMeta writes r as the task meta a key-value result backend (Redis:
// the value of celery-task-meta-<id>) stores: {"status", "result",
// "traceback", "children", "date_done", "task_id"} and the request's
// fields, in r.Serializer (json by default). now is date_done for the
// ready states (null otherwise). It returns the content type and the body.
func EncodeMeta(r *Result, req *MetaRequest, now time.Time) (contentType string, body []byte, err error) {
	if r == nil || r.TaskID == "" || r.Status == "" {
		return "", nil, fmt.Errorf("celeryproto: encode meta: task id and status are required")
	}
	result := r.resultValue()
	var tb, done any
	if r.Traceback != "" {
		tb = r.Traceback
	}
	if readyState(r.Status) {
		done = FormatDateDone(now)
	}
	children := r.Children
	if children == nil {
		children = []any{}
	}
	meta := map[string]any{"status": string(r.Status), "result": result, "traceback": tb,
		"children": children, "date_done": done, "task_id": r.TaskID}
	if req != nil {
		if req.GroupID != "" {
			meta["group_id"] = req.GroupID
		}
		if req.ParentID != "" {
			meta["parent_id"] = req.ParentID
		}
		if req.Extended {
			var args any = req.Args
			if req.Args == nil {
				args = []any{}
			}
			var kwargs any = req.Kwargs
			if req.Kwargs == nil {
				kwargs = map[string]any{}
			}
			var name, worker, queue any
			if req.Name != "" {
				name = req.Name
			}
			if req.Worker != "" {
				worker = req.Worker
			}
			if req.Queue != "" {
				queue = req.Queue
			}
			meta["name"], meta["args"], meta["kwargs"] = name, args, kwargs
			meta["worker"], meta["retries"], meta["queue"] = worker, int64(req.Retries), queue
		}
	}
	ser := r.Serializer
	if ser == "" {
		ser = "json"
	}
	ct, _, b, err := marshal(ser, meta)
	if err != nil {
		return "", nil, fmt.Errorf("celeryproto: encode meta of %s: %w", r.TaskID, err)
	}
	return ct, b, nil
}
