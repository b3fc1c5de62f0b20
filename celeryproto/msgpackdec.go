package celeryproto

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"time"
)

// msgpackDecoder reads msgpack into the package's value types. It is
// written for hostile input: a declared length never allocates more than
// the bytes that remain could hold, and nesting is bounded.
type msgpackDecoder struct {
	data []byte
	pos  int
	mt   *meter // nil: unmetered
}

var errMsgpack = errors.New("invalid msgpack")

func decodeMsgpack(data []byte, mt *meter) (any, error) {
	d := msgpackDecoder{data: data, mt: mt}
	v, err := d.value(0)
	if err != nil {
		return nil, err
	}
	if d.pos != len(d.data) {
		return nil, d.errorf("trailing data")
	}
	return v, nil
}

func (d *msgpackDecoder) errorf(format string, args ...any) error {
	return fmt.Errorf("%w at offset %d: %s", errMsgpack, d.pos, fmt.Sprintf(format, args...))
}

func (d *msgpackDecoder) take(n int) ([]byte, error) {
	if n < 0 || len(d.data)-d.pos < n {
		return nil, d.errorf("unexpected end of input")
	}
	b := d.data[d.pos : d.pos+n]
	d.pos += n
	return b, nil
}

// length reads a big-endian length of size bytes.
func (d *msgpackDecoder) length(size int) (int, error) {
	b, err := d.take(size)
	if err != nil {
		return 0, err
	}
	switch size {
	case 1:
		return int(b[0]), nil
	case 2:
		return int(binary.BigEndian.Uint16(b)), nil
	default:
		return int(binary.BigEndian.Uint32(b)), nil
	}
}

func (d *msgpackDecoder) value(depth int) (any, error) {
	if depth > maxDepth {
		return nil, d.errorf("nesting deeper than %d", maxDepth)
	}
	b, err := d.take(1)
	if err != nil {
		return nil, err
	}
	if err := d.mt.charge(1, 0); err != nil {
		return nil, err
	}
	c := b[0]
	switch {
	case c <= 0x7f:
		return int64(c), nil
	case c >= 0xe0:
		return int64(int8(c)), nil
	case c >= 0x80 && c <= 0x8f:
		return d.mapOf(int(c&0x0f), depth)
	case c >= 0x90 && c <= 0x9f:
		return d.arrayOf(int(c&0x0f), depth)
	case c >= 0xa0 && c <= 0xbf:
		return d.str(int(c & 0x1f))
	}
	switch c {
	case 0xc0:
		return nil, nil
	case 0xc2:
		return false, nil
	case 0xc3:
		return true, nil
	case 0xc4, 0xc5, 0xc6:
		n, err := d.length(1 << (c - 0xc4))
		if err != nil {
			return nil, err
		}
		raw, err := d.take(n)
		if err != nil {
			return nil, err
		}
		if err := d.mt.charge(0, n); err != nil {
			return nil, err
		}
		return append([]byte(nil), raw...), nil
	case 0xc7, 0xc8, 0xc9:
		n, err := d.length(1 << (c - 0xc7))
		if err != nil {
			return nil, err
		}
		return d.ext(n)
	case 0xca:
		raw, err := d.take(4)
		if err != nil {
			return nil, err
		}
		return float64(math.Float32frombits(binary.BigEndian.Uint32(raw))), nil
	case 0xcb:
		raw, err := d.take(8)
		if err != nil {
			return nil, err
		}
		return math.Float64frombits(binary.BigEndian.Uint64(raw)), nil
	case 0xcc, 0xcd, 0xce, 0xcf:
		raw, err := d.take(1 << (c - 0xcc))
		if err != nil {
			return nil, err
		}
		return uintValue(beUint(raw)), nil
	case 0xd0, 0xd1, 0xd2, 0xd3:
		raw, err := d.take(1 << (c - 0xd0))
		if err != nil {
			return nil, err
		}
		u := beUint(raw)
		shift := 64 - 8*len(raw)
		return int64(u<<shift) >> shift, nil
	case 0xd4, 0xd5, 0xd6, 0xd7, 0xd8:
		return d.ext(1 << (c - 0xd4))
	case 0xd9, 0xda, 0xdb:
		n, err := d.length(1 << (c - 0xd9))
		if err != nil {
			return nil, err
		}
		return d.str(n)
	case 0xdc, 0xdd:
		n, err := d.length(2 << (c - 0xdc))
		if err != nil {
			return nil, err
		}
		return d.arrayOf(n, depth)
	case 0xde, 0xdf:
		n, err := d.length(2 << (c - 0xde))
		if err != nil {
			return nil, err
		}
		return d.mapOf(n, depth)
	}
	d.pos--
	return nil, d.errorf("reserved type byte 0x%02x", c)
}

func beUint(b []byte) uint64 {
	var u uint64
	for _, x := range b {
		u = u<<8 | uint64(x)
	}
	return u
}

func (d *msgpackDecoder) str(n int) (any, error) {
	raw, err := d.take(n)
	if err != nil {
		return nil, err
	}
	if err := d.mt.charge(0, n); err != nil {
		return nil, err
	}
	return string(raw), nil
}

func (d *msgpackDecoder) arrayOf(n, depth int) (any, error) {
	if n > len(d.data)-d.pos { // every element takes at least one byte
		return nil, d.errorf("array of %d elements in %d bytes", n, len(d.data)-d.pos)
	}
	if err := d.mt.fits(n); err != nil {
		return nil, err
	}
	out := make([]any, n)
	for i := range out {
		v, err := d.value(depth + 1)
		if err != nil {
			return nil, err
		}
		out[i] = v
	}
	return out, nil
}

func (d *msgpackDecoder) mapOf(n, depth int) (any, error) {
	if n > (len(d.data)-d.pos)/2 { // every entry takes at least two bytes
		return nil, d.errorf("map of %d entries in %d bytes", n, len(d.data)-d.pos)
	}
	if err := d.mt.fits(2 * n); err != nil {
		return nil, err
	}
	if n > 0 { // a map with entries takes a group of 8 slots at least
		if err := d.mt.charge(0, mapGroupCost); err != nil {
			return nil, err
		}
	}
	out := make(map[string]any, n)
	for range n {
		k, err := d.value(depth + 1)
		if err != nil {
			return nil, err
		}
		switch k.(type) {
		case []any, map[string]any:
			return nil, d.errorf("map key of type %s", typeName(k))
		}
		v, err := d.value(depth + 1)
		if err != nil {
			return nil, err
		}
		out[keyString(k)] = v
	}
	return out, nil
}

// ext reads an extension value of n data bytes; only the timestamp type
// (-1) is defined for Celery's data.
func (d *msgpackDecoder) ext(n int) (any, error) {
	tb, err := d.take(1)
	if err != nil {
		return nil, err
	}
	raw, err := d.take(n)
	if err != nil {
		return nil, err
	}
	if int8(tb[0]) != -1 {
		return nil, d.errorf("unsupported extension type %d", int8(tb[0]))
	}
	switch n {
	case 4:
		return time.Unix(int64(binary.BigEndian.Uint32(raw)), 0).UTC(), nil
	case 8:
		v := binary.BigEndian.Uint64(raw)
		return time.Unix(int64(v&(1<<34-1)), int64(v>>34)).UTC(), nil
	case 12:
		ns := binary.BigEndian.Uint32(raw[:4])
		return time.Unix(int64(binary.BigEndian.Uint64(raw[4:])), int64(ns)).UTC(), nil
	}
	return nil, d.errorf("timestamp extension of %d bytes", n)
}
