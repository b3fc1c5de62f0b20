package celeryproto

import (
	"errors"
	"fmt"
)

// Sentinel errors. Every error returned by the decoder is a *DecodeError that
// matches exactly one of them with errors.Is, so the consumer can decide what
// to do (all of them mean the message can never be decoded: quarantine it).
var (
	// ErrUnsupportedContentType: a content type this package does not decode.
	ErrUnsupportedContentType = errors.New("unsupported content type")
	// ErrPickle: a pickle body, refused without being looked at.
	ErrPickle = errors.New("pickle content refused")
	// ErrCompression: an unknown compression or a corrupt compressed body.
	ErrCompression = errors.New("bad compression")
	// ErrTooLarge: the body, once decompressed, exceeds Limits.MaxBodyBytes.
	ErrTooLarge = errors.New("body too large")
	// ErrMalformed: the body is not valid for its serializer (truncated, garbage).
	ErrMalformed = errors.New("malformed body")
	// ErrShape: the body decodes but does not have the shape of a Celery message.
	ErrShape = errors.New("wrong message shape")
	// ErrBadHeader: a header or body field has the wrong type or an unparsable value.
	ErrBadHeader = errors.New("bad header")
)

// DecodeError says why a delivery could not be decoded.
type DecodeError struct {
	// Reason is one of the sentinel errors above.
	Reason error
	// Detail says what exactly was wrong, e.g. `unsupported content type
	// "application/x-python-serialize"`.
	Detail string
	// Err is the underlying error, if any.
	Err error
}

// Error implements error.
func (e *DecodeError) Error() string {
	msg := "celeryproto: " + e.Detail
	if e.Err != nil {
		msg += ": " + e.Err.Error()
	}
	return msg
}

// Unwrap returns the sentinel and the underlying error.
func (e *DecodeError) Unwrap() []error {
	if e.Err == nil {
		return []error{e.Reason}
	}
	return []error{e.Reason, e.Err}
}

func decodeErr(reason error, err error, format string, args ...any) *DecodeError {
	return &DecodeError{Reason: reason, Detail: fmt.Sprintf(format, args...), Err: err}
}

// IsDecodeError reports whether err (or an error it wraps) is a *DecodeError.
func IsDecodeError(err error) bool {
	var de *DecodeError
	return errors.As(err, &de)
}

// Reason returns a short, single-line reason for err, suitable for a
// quarantine header: the DecodeError detail when there is one, else the
// error text. It never contains argument values.
func Reason(err error) string {
	if err == nil {
		return ""
	}
	var de *DecodeError
	if errors.As(err, &de) {
		if de.Err != nil {
			return de.Detail + ": " + de.Err.Error()
		}
		return de.Detail
	}
	return err.Error()
}
