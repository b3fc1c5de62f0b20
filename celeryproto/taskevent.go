package celeryproto

import (
	"crypto/sha256"
	"encoding/hex"
	"strconv"
)

// onceler's own task event fields; Celery's readers keep unknown fields as
// attributes of the task, so Flower and celery.events.State show them.
const (
	// FieldDuplicate is true on a task-succeeded answered from the record.
	FieldDuplicate = "onceler_duplicate"
	// FieldKeyHash is KeyHash(operation key).
	FieldKeyHash = "onceler_key_sha256"
)

// KeyHash identifies an operation key in events without revealing it: the
// first 8 bytes of its SHA-256, in hex.
func KeyHash(key string) string {
	sum := sha256.Sum256([]byte(key))
	return hex.EncodeToString(sum[:8])
}

// TaskEvent is a Celery task event as a value: the fields the worker sends
// for each event type, without a map. AppendTaskEvent encodes it as
// AppendEvent encodes the map Fields returns, and allocates nothing but the
// growth of dst; a publisher that takes TaskEvent values saves a map and a
// boxed value per field on every event.
//
// Which fields an event carries depends on Type:
//
//	task-received   args, kwargs, root_id, parent_id (null when empty), retries, eta, expires
//	task-started    (none)
//	task-succeeded  result, runtime, and onceler_duplicate when Duplicate
//	task-failed     exception, traceback
//	task-retried    exception, traceback
//	task-revoked    terminated, signum, expired
//	task-rejected   requeue
//
// and every one uuid, name when Name is set, and onceler_key_sha256 when
// KeyHash is set.
type TaskEvent struct {
	Type    string
	UUID    string
	Name    string // "": left out
	KeyHash string // KeyHash(operation key); "": left out

	// task-received
	Args, Kwargs     string // their Python reprs
	RootID, ParentID string
	Retries          int
	ETA, Expires     string // "": null

	// task-succeeded
	Result    string // the Python repr of the result
	Runtime   float64
	Duplicate bool // answered from the record

	// task-failed, task-retried
	Exception, Traceback string

	// task-revoked
	Terminated bool
	Signum     int // 0: null
	Expired    bool

	// task-rejected
	Requeue bool
}

// Fields returns the event's fields as a map (without the stamp), as an
// Observer that takes maps receives them.
func (e *TaskEvent) Fields() map[string]any {
	f := make(map[string]any, 10)
	f["uuid"] = e.UUID
	if e.Name != "" {
		f["name"] = e.Name
	}
	if e.KeyHash != "" {
		f[FieldKeyHash] = e.KeyHash
	}
	orNil := func(s string) any {
		if s == "" {
			return nil
		}
		return s
	}
	switch e.Type {
	case "task-received":
		f["args"], f["kwargs"], f["root_id"], f["parent_id"] = e.Args, e.Kwargs, orNil(e.RootID), orNil(e.ParentID)
		f["retries"], f["eta"], f["expires"] = e.Retries, orNil(e.ETA), orNil(e.Expires)
	case "task-succeeded":
		f["result"], f["runtime"] = e.Result, e.Runtime
		if e.Duplicate {
			f[FieldDuplicate] = true
		}
	case "task-failed", "task-retried":
		f["exception"], f["traceback"] = e.Exception, e.Traceback
	case "task-revoked":
		var signum any
		if e.Signum != 0 {
			signum = e.Signum
		}
		f["terminated"], f["signum"], f["expired"] = e.Terminated, signum, e.Expired
	case "task-rejected":
		f["requeue"] = e.Requeue
	}
	return f
}

// AppendTaskEvent appends the event as one JSON object to dst: the stamp's
// fields (its Type is the event's), then the event's own.
func AppendTaskEvent(dst []byte, s EventStamp, e *TaskEvent) ([]byte, error) {
	s.Type = e.Type
	b, err := appendStamp(dst, s)
	if err != nil {
		return dst, err
	}
	b = appendStringField(b, "uuid", e.UUID)
	if e.Name != "" {
		b = appendStringField(b, "name", e.Name)
	}
	if e.KeyHash != "" {
		b = appendStringField(b, FieldKeyHash, e.KeyHash)
	}
	switch e.Type {
	case "task-received":
		b = appendStringField(b, "args", e.Args)
		b = appendStringField(b, "kwargs", e.Kwargs)
		b = appendNullableField(b, "root_id", e.RootID)
		b = appendNullableField(b, "parent_id", e.ParentID)
		b = append(b, `,"retries":`...)
		b = strconv.AppendInt(b, int64(e.Retries), 10)
		b = appendNullableField(b, "eta", e.ETA)
		b = appendNullableField(b, "expires", e.Expires)
	case "task-succeeded":
		b = appendStringField(b, "result", e.Result)
		b = append(b, `,"runtime":`...)
		if b, err = appendEventFloat(b, e.Runtime); err != nil {
			return dst, err
		}
		if e.Duplicate {
			b = appendBoolField(b, FieldDuplicate, true)
		}
	case "task-failed", "task-retried":
		b = appendStringField(b, "exception", e.Exception)
		b = appendStringField(b, "traceback", e.Traceback)
	case "task-revoked":
		b = appendBoolField(b, "terminated", e.Terminated)
		b = append(b, `,"signum":`...)
		if e.Signum != 0 {
			b = strconv.AppendInt(b, int64(e.Signum), 10)
		} else {
			b = append(b, "null"...)
		}
		b = appendBoolField(b, "expired", e.Expired)
	case "task-rejected":
		b = appendBoolField(b, "requeue", e.Requeue)
	}
	b = append(b, `,"timestamp":`...)
	if b, err = appendEventFloat(b, s.Timestamp); err != nil {
		return dst, err
	}
	return append(b, '}'), nil
}

// appendKey appends the separator and key of the next field: ,"key":
func appendKey(b []byte, key string) []byte {
	b = append(b, ',', '"')
	b = append(b, key...)
	return append(b, '"', ':')
}

func appendStringField(b []byte, key, v string) []byte {
	return appendEventString(appendKey(b, key), v)
}

func appendNullableField(b []byte, key, v string) []byte {
	if v == "" {
		return append(appendKey(b, key), "null"...)
	}
	return appendStringField(b, key, v)
}

func appendBoolField(b []byte, key string, v bool) []byte {
	return strconv.AppendBool(appendKey(b, key), v)
}
