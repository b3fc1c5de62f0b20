package celeryproto

import "github.com/onceler/onceler/internal/uuid"

// NewTaskID returns a new random version 4 UUID in its text form, as Celery
// makes task ids (and kombu its delivery tags).
func NewTaskID() string { return uuid.New() }
