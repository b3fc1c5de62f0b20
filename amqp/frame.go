package amqp

import (
	"fmt"
	"math"
	"time"

	amqp091 "github.com/onceler/onceler/internal/amqp091"
)

// What amqp091-go would write for a publish, measured before it is sent:
// amqp091 writes a short string over 255 bytes as an error that closes the
// whole connection, and RabbitMQ closes the connection on a header frame
// larger than frame_max. Measuring first turns both into a RefusedError
// for this publish alone.

// frameOverhead is a frame's type, channel, size and end octet.
const frameOverhead = 8

// shortMax is the longest AMQP short string.
const shortMax = 255

// checkNames refuses a publish whose exchange, routing key or short-string
// properties are longer than a short string.
func checkNames(exchange, key string, pub *amqp091.Publishing) error {
	for _, f := range []struct{ name, v string }{
		{"exchange", exchange}, {"routing key", key}, {"content_type", pub.ContentType},
		{"content_encoding", pub.ContentEncoding}, {"correlation_id", pub.CorrelationId},
		{"reply_to", pub.ReplyTo}, {"expiration", pub.Expiration}, {"message_id", pub.MessageId},
		{"type", pub.Type}, {"user_id", pub.UserId}, {"app_id", pub.AppId},
	} {
		if len(f.v) > shortMax {
			return refused("publish", exchange, key, 0,
				fmt.Sprintf("%s of %d bytes is longer than an AMQP short string (255 bytes)", f.name, len(f.v)), ErrTooLong)
		}
	}
	return nil
}

// checkFrame refuses a publish whose content header frame (properties and
// headers) would be larger than frameMax (0: no limit). The frame is
// measured whole, its 8 bytes of overhead included, as AMQP 0-9-1 defines
// frame_max (RabbitMQ closes the connection only on a payload over it).
func checkFrame(exchange, key string, pub *amqp091.Publishing, frameMax int) error {
	n, err := headerFrameSize(pub)
	if err != nil {
		return refused("publish", exchange, key, 0, err.Error(), err)
	}
	if frameMax > 0 && n > frameMax {
		return refused("publish", exchange, key, 0,
			fmt.Sprintf("properties and headers take a frame of %d bytes, frame_max is %d", n, frameMax), ErrFrameTooLarge)
	}
	return nil
}

// HeadersSize returns the encoded size of headers as a Publisher sends
// them (an AMQP field table, its 4-byte length included): what they take
// of a frame. It fails with ErrTooLong for a name over 255 bytes, and for a
// value that cannot be an AMQP header.
func HeadersSize(h map[string]any) (int, error) {
	t, err := toTable(h)
	if err != nil {
		return 0, err
	}
	return tableSize(t)
}

// headerFrameSize returns the size in bytes of the content header frame
// amqp091-go writes for pub, frame overhead included, as RabbitMQ compares
// it with frame_max. It fails with ErrTooLong for a header name over 255
// bytes, and for a value amqp091 cannot encode.
func headerFrameSize(pub *amqp091.Publishing) (int, error) {
	n := frameOverhead + 2 + 2 + 8 + 2 // class, weight, body size, flags
	for _, s := range []string{pub.ContentType, pub.ContentEncoding, pub.CorrelationId, pub.ReplyTo,
		pub.Expiration, pub.MessageId, pub.Type, pub.UserId, pub.AppId} {
		if s != "" {
			n += 1 + len(s)
		}
	}
	if len(pub.Headers) > 0 {
		t, err := tableSize(pub.Headers)
		if err != nil {
			return 0, err
		}
		n += t
	}
	if pub.DeliveryMode > 0 {
		n++
	}
	if pub.Priority > 0 {
		n++
	}
	if !pub.Timestamp.IsZero() {
		n += 8
	}
	return n, nil
}

// tableSize returns the encoded size of an AMQP field table as amqp091-go
// writes it (its 4-byte length included).
func tableSize(t amqp091.Table) (int, error) {
	n := 4
	for k, v := range t {
		if len(k) > shortMax {
			return 0, fmt.Errorf("header name of %d bytes: %w", len(k), ErrTooLong)
		}
		f, err := fieldSize(v)
		if err != nil {
			return 0, fmt.Errorf("header %s: %w", shown(k), err)
		}
		n += 1 + len(k) + f
		if n > math.MaxInt32 {
			return 0, fmt.Errorf("headers of over %d bytes: %w", math.MaxInt32, ErrFrameTooLarge)
		}
	}
	return n, nil
}

// fieldSize is the encoded size of one field value, its type octet
// included, as amqp091's writeField writes it.
func fieldSize(v any) (int, error) {
	switch x := v.(type) {
	case nil:
		return 1, nil
	case bool, byte, int8:
		return 2, nil
	case int16, uint16:
		return 3, nil
	case int, int32, uint32, float32:
		return 5, nil
	case int64, float64, time.Time:
		return 9, nil
	case amqp091.Decimal:
		return 6, nil
	case string:
		return 5 + len(x), nil
	case []byte:
		return 5 + len(x), nil
	case []any:
		n := 5
		for i, e := range x {
			f, err := fieldSize(e)
			if err != nil {
				return 0, fmt.Errorf("item %d: %w", i, err)
			}
			n += f
		}
		return n, nil
	case amqp091.Table:
		t, err := tableSize(x)
		return 1 + t, err
	}
	return 0, fmt.Errorf("type %T: %w", v, amqp091.ErrFieldType)
}
