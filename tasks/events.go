package tasks

import (
	"github.com/onceler/onceler/celeryproto"
)

// succeededEvent is task-succeeded: result, the Python repr of the JSON
// result (as Celery's saferepr), and runtime in seconds.
func succeededEvent(res []byte, runtime float64, duplicate bool) *celeryproto.TaskEvent {
	return &celeryproto.TaskEvent{Type: "task-succeeded", Result: resultRepr(res), Runtime: runtime, Duplicate: duplicate}
}

// failedEvent is task-failed (or task-retried): exception, the Python repr of
// the exception, and traceback: here a short one in Python's shape naming
// the task and the exception; a failure of the task function gets its Go
// frames instead (taskTraceback, traceback.go).
func failedEvent(typ, task string, exc *celeryproto.Exception) *celeryproto.TaskEvent {
	return &celeryproto.TaskEvent{Type: typ,
		Exception: exc.Type + "(" + celeryproto.StringRepr(exc.Message) + ")",
		Traceback: "Traceback (most recent call last):\n  onceler Go task " + celeryproto.StringRepr(task) + "\n" +
			exc.Type + ": " + exc.Message + "\n"}
}

// resultRepr is the Python repr of a JSON result, at most 1024 bytes (cut
// as saferepr does, with "...").
func resultRepr(res []byte) string {
	// The results most tasks return, without decoding them.
	switch string(res) {
	case "", "null":
		return "None"
	case "true":
		return "True"
	case "false":
		return "False"
	}
	v, err := jsonValue(res)
	if err != nil {
		return string(res)
	}
	return celeryproto.Repr(v)
}
