package celeryproto

import (
	"crypto/rand"
	"encoding/hex"
)

// NewTaskID returns a new random version 4 UUID in its text form, as Celery
// makes task ids (and kombu its delivery tags).
func NewTaskID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}
