// Package uuid makes version 4 UUIDs in their text form, as Celery makes
// task ids and kombu its delivery tags. It imports nothing of the project,
// so that every package and every test helper can use it.
package uuid

import (
	"crypto/rand"
	"encoding/hex"
)

// New returns a new random version 4 UUID.
func New() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand, Go 1.24+)
	return Form(b)
}

// Form returns b in the form of a version 4 UUID: its version and variant
// bits set, the rest kept. A digest's first 16 bytes give a UUID that is
// the same for the same input.
func Form(b [16]byte) string {
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}
