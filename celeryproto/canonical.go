package celeryproto

import (
	"crypto/sha256"
	"fmt"
)

// CanonicalArgs returns a stable byte form of args and kwargs for
// fingerprints: JSON with sorted keys, integers of every width written the
// same, integral floats as floats, float32 widened, times in FormatTime
// form and bytes as base64. The same Python call sent as JSON or msgpack
// gives the same bytes.
func CanonicalArgs(args []any, kwargs map[string]any) ([]byte, error) {
	if args == nil {
		args = []any{}
	}
	if kwargs == nil {
		kwargs = map[string]any{}
	}
	b := make([]byte, 0, 128)
	b = append(b, '[')
	var err error
	if b, err = appendJSONValue(b, args, 1); err != nil {
		return nil, fmt.Errorf("celeryproto: canonical args: %w", err)
	}
	b = append(b, ", "...)
	if b, err = appendJSONValue(b, kwargs, 1); err != nil {
		return nil, fmt.Errorf("celeryproto: canonical kwargs: %w", err)
	}
	return append(b, ']'), nil
}

// Fingerprint returns the sha256 of CanonicalArgs.
func Fingerprint(args []any, kwargs map[string]any) ([]byte, error) {
	c, err := CanonicalArgs(args, kwargs)
	if err != nil {
		return nil, err
	}
	sum := sha256.Sum256(c)
	return sum[:], nil
}
