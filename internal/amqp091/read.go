// Copyright (c) 2021 VMware, Inc. or its affiliates. All Rights Reserved.
// Copyright (c) 2012-2021, Sean Treadway, SoundCloud Ltd.
// Use of this source code is governed by a BSD-style
// license that can be found in the LICENSE file.

package amqp091

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"time"
	"unsafe"
)

/*
ReadFrame reads a frame from an input stream and returns an interface that can be cast into
one of the following:

	methodFrame
	PropertiesFrame
	bodyFrame
	heartbeatFrame

2.3.5  frame Details

All frames consist of a header (7 octets), a payload of arbitrary size, and a
'frame-end' octet that detects malformed frames:

	0      1         3             7                  size+7 size+8
	+------+---------+-------------+  +------------+  +-----------+
	| type | channel |     size    |  |  payload   |  | frame-end |
	+------+---------+-------------+  +------------+  +-----------+
	 octet   short         long         size octets       octet

To read a frame, we:
 1. Read the header and check the frame type and channel.
 2. Depending on the frame type, we read the payload and process it.
 3. Read the frame end octet.

In realistic implementations where performance is a concern, we would use
“read-ahead buffering” or

“gathering reads” to avoid doing three separate system calls to read a frame.
*/
func (r *reader) ReadFrame() (frame frame, err error) {
	var scratch [7]byte

	if _, err = io.ReadFull(r.r, scratch[:7]); err != nil {
		return
	}

	typ := scratch[0]
	channel := binary.BigEndian.Uint16(scratch[1:3])
	size := binary.BigEndian.Uint32(scratch[3:7])

	if r.maxFrameSize != nil {
		// max-frameHeaderSize is safe from underflow only because maxFrameSize,
		// whenever nonzero, is always negotiateFrameSize's floor (frameMinSize,
		// 4096) or higher — see the Store call at Connection.openTune.
		if max := r.maxFrameSize.Load(); max > 0 && size > (max-frameHeaderSize) {
			return nil, ErrFrameTooLarge
		}
	}

	switch typ {
	case frameMethod:
		if frame, err = r.parseMethodFrame(channel, size); err != nil {
			return
		}

	case frameHeader:
		if frame, err = r.parseHeaderFrame(channel, size); err != nil {
			return
		}

	case frameBody:
		if frame, err = r.parseBodyFrame(channel, size); err != nil {
			return nil, err
		}

	case frameHeartbeat:
		if frame, err = r.parseHeartbeatFrame(channel, size); err != nil {
			return
		}

	default:
		return nil, ErrFrame
	}

	if _, err = io.ReadFull(r.r, scratch[:1]); err != nil {
		return nil, err
	}

	if scratch[0] != frameEnd {
		return nil, ErrFrame
	}

	return
}

// readAllocChunk caps how far readBytes allocates ahead of data confirmed
// present on the wire, so a fabricated length field cannot force a large
// allocation on its own.
const readAllocChunk = 64 * 1024

func min64(a, b int64) int64 {
	if a < b {
		return a
	}
	return b
}

// readBytes reads exactly n bytes, growing the buffer in readAllocChunk
// increments so it never allocates far ahead of confirmed data.
func readBytes(r io.Reader, n int64) ([]byte, error) {
	if n < 0 {
		return nil, ErrSyntax
	}

	buf := make([]byte, 0, min64(n, readAllocChunk))
	for int64(len(buf)) < n {
		chunk := int(min64(n-int64(len(buf)), readAllocChunk))
		old := len(buf)

		// append grows the backing array with Go's amortized (roughly
		// doubling) strategy, so repeated chunks don't each re-copy the
		// entire buffer read so far.
		buf = append(buf, make([]byte, chunk)...)

		if _, err := io.ReadFull(r, buf[old:]); err != nil {
			return nil, err
		}
	}
	return buf, nil
}

func readShortstr(r io.Reader) (v string, err error) {
	var length uint8
	if err = binary.Read(r, binary.BigEndian, &length); err != nil {
		return
	}

	bytes, err := readBytes(r, int64(length))
	if err != nil {
		return
	}
	return bytesString(bytes), nil
}

// bytesString is b as a string without a copy (onceler): b must be a
// buffer of its own that nothing writes to afterwards, as readBytes'.
func bytesString(b []byte) string {
	if len(b) == 0 {
		return ""
	}
	return unsafe.String(&b[0], len(b))
}

func readLongstr(r io.Reader) (v string, err error) {
	var length uint32
	if err = binary.Read(r, binary.BigEndian, &length); err != nil {
		return
	}

	// slices can't be longer than max int32 value
	if length > (^uint32(0) >> 1) {
		return "", ErrSyntax
	}

	bytes, err := readBytes(r, int64(length))
	if err != nil {
		return
	}
	return bytesString(bytes), nil
}

func readDecimal(r io.Reader) (v Decimal, err error) {
	if err = binary.Read(r, binary.BigEndian, &v.Scale); err != nil {
		return
	}
	if err = binary.Read(r, binary.BigEndian, &v.Value); err != nil {
		return
	}
	return
}

func readTimestamp(r io.Reader) (v time.Time, err error) {
	var sec int64
	if err = binary.Read(r, binary.BigEndian, &sec); err != nil {
		return
	}
	return time.Unix(sec, 0), nil
}

/*
'A': any
'D': Decimal
'F': Table
'I': int32
'S': string
'T': time.Time
'V': nil
'b': int8
'B': byte
'd': float64
'f': float32
'l': int64
'L': int64 (onceler: as py-amqp writes and reads it)
'i': uint32
's': int16
'u': uint16
't': bool
'x': []byte
*/
// maxFieldDepth limits how deeply 'A' and 'F' fields may nest, preventing
// unbounded recursion from overflowing the goroutine stack.
const maxFieldDepth = 32

// maxContainerElements limits how many elements/entries readArrayDepth and
// readTableDepth will accept in a single container. AMQP tables/arrays in
// practice hold at most a few hundred entries (message properties, queue
// arguments, policy definitions); this cap rejects the empty-value ('V')
// padding trick that would otherwise amplify wire bytes ~16-40x into heap via
// boxed `any` slice elements / Table map entries.
const maxContainerElements = 8192

func readField(r io.Reader) (v any, err error) {
	return readFieldDepth(r, 0)
}

// readFieldDepth reads a field from r (onceler: as a table's field, from
// the field's bytes on; used by upstream's tests).
func readFieldDepth(r io.Reader, depth int) (v any, err error) {
	b, err := io.ReadAll(r)
	if err != nil {
		return nil, err
	}
	return (&strReader{s: string(b)}).field(depth)
}

// strReader reads a table's fields from the string that holds them
// (onceler: in place of a bytes.Buffer and binary.Read, which allocate for
// every key, string and number). Keys and string values are substrings of
// that string, not copies. take fails as io.ReadFull over readBytes'
// chunks would: io.EOF when nothing (or a whole number of chunks) was
// left, io.ErrUnexpectedEOF otherwise; what was left is consumed.
type strReader struct{ s string }

func (r *strReader) take(n int) (string, error) {
	if n <= len(r.s) {
		v := r.s[:n]
		r.s = r.s[n:]
		return v, nil
	}
	left := len(r.s)
	r.s = ""
	if left%readAllocChunk == 0 {
		return "", io.EOF
	}
	return "", io.ErrUnexpectedEOF
}

func (r *strReader) u8() (uint8, error) {
	v, err := r.take(1)
	if err != nil {
		return 0, err
	}
	return v[0], nil
}

func (r *strReader) u16() (uint16, error) {
	v, err := r.take(2)
	if err != nil {
		return 0, err
	}
	return uint16(v[0])<<8 | uint16(v[1]), nil
}

func (r *strReader) u32() (uint32, error) {
	v, err := r.take(4)
	if err != nil {
		return 0, err
	}
	return uint32(v[0])<<24 | uint32(v[1])<<16 | uint32(v[2])<<8 | uint32(v[3]), nil
}

func (r *strReader) u64() (uint64, error) {
	v, err := r.take(8)
	if err != nil {
		return 0, err
	}
	return uint64(v[0])<<56 | uint64(v[1])<<48 | uint64(v[2])<<40 | uint64(v[3])<<32 |
		uint64(v[4])<<24 | uint64(v[5])<<16 | uint64(v[6])<<8 | uint64(v[7]), nil
}

func (r *strReader) shortstr() (string, error) {
	n, err := r.u8()
	if err != nil {
		return "", err
	}
	return r.take(int(n))
}

func (r *strReader) longstr() (string, error) {
	n, err := r.u32()
	if err != nil {
		return "", err
	}
	// slices can't be longer than max int32 value
	if n > (^uint32(0) >> 1) {
		return "", ErrSyntax
	}
	return r.take(int(n))
}

func (r *strReader) timestamp() (time.Time, error) {
	sec, err := r.u64()
	if err != nil {
		return time.Time{}, err
	}
	return time.Unix(int64(sec), 0), nil
}

// field reads a field: its type octet, then its value.
func (r *strReader) field(depth int) (v any, err error) {
	typ, err := r.u8()
	if err != nil {
		return nil, err
	}

	switch typ {
	case 't':
		value, err := r.u8()
		if err != nil {
			return nil, err
		}
		return value != 0, nil

	case 'B':
		value, err := r.u8()
		if err != nil {
			return nil, err
		}
		return value, nil

	case 'b':
		value, err := r.u8()
		if err != nil {
			return nil, err
		}
		return int8(value), nil

	case 's':
		value, err := r.u16()
		if err != nil {
			return nil, err
		}
		return int16(value), nil

	case 'I':
		value, err := r.u32()
		if err != nil {
			return nil, err
		}
		return int32(value), nil

	// onceler: py-amqp, Celery's client, writes an integer beyond 32 bits
	// as 'L' holding a signed 64-bit value, and reads 'L' back the same way.
	case 'l', 'L':
		value, err := r.u64()
		if err != nil {
			return nil, err
		}
		return int64(value), nil

	case 'u':
		value, err := r.u16()
		if err != nil {
			return nil, err
		}
		return value, nil

	case 'i':
		value, err := r.u32()
		if err != nil {
			return nil, err
		}
		return value, nil

	case 'f':
		value, err := r.u32()
		if err != nil {
			return nil, err
		}
		return math.Float32frombits(value), nil

	case 'd':
		value, err := r.u64()
		if err != nil {
			return nil, err
		}
		return math.Float64frombits(value), nil

	case 'D':
		var d Decimal
		if d.Scale, err = r.u8(); err != nil {
			return d, err
		}
		value, err := r.u32()
		if err != nil {
			return d, err
		}
		d.Value = int32(value)
		return d, nil

	case 'S':
		return r.longstr()

	case 'A':
		return r.array(depth + 1)

	case 'T':
		return r.timestamp()

	case 'F':
		if depth+1 > maxFieldDepth {
			return nil, errTooDeep
		}
		str, err := r.longstr()
		if err != nil {
			return nil, err
		}
		return parseTableDepth(str, depth+1)

	case 'x':
		n, err := r.u32()
		if err != nil {
			return nil, err
		}
		if int32(n) < 0 {
			return nil, ErrSyntax
		}
		s, err := r.take(int(n))
		if err != nil {
			return nil, err
		}
		value := make([]byte, len(s))
		copy(value, s)
		return value, nil

	case 'V':
		return nil, nil
	}

	return nil, fmt.Errorf("unknown field type %q", typ)
}

/*
Field tables are long strings that contain packed name-value pairs.  The
name-value pairs are encoded as short string defining the name, and octet
defining the values type and then the value itself.   The valid field types for
tables are an extension of the native integer, bit, string, and timestamp
types, and are shown in the grammar.  Multi-octet integer fields are always
held in network byte order.
*/
func readTable(r io.Reader) (table Table, err error) {
	return readTableDepth(r, 0)
}

func readTableDepth(r io.Reader, depth int) (table Table, err error) {
	if depth > maxFieldDepth {
		return nil, errTooDeep
	}

	var str string

	if str, err = readLongstr(r); err != nil {
		return
	}

	return parseTableDepth(str, depth)
}

// parseTableDepth parses the bytes of a table, its length prefix already
// read (onceler: split from readTableDepth for readContentHeaders).
func parseTableDepth(str string, depth int) (table Table, err error) {
	nested := strReader{s: str}

	// onceler: the top-level table is sized for about one entry per 24
	// bytes (a key of a few letters and a short value, as in a Celery
	// message's headers), so that it does not grow entry by entry; at most
	// 64 ahead of its bytes. Nested tables grow as they fill: the bytes of
	// one count for every table around it, and sizing each by them would
	// let a small frame of deeply nested tables take megabytes.
	if depth == 0 {
		table = make(Table, min(len(str)/24, 64))
	} else {
		table = make(Table)
	}

	for len(nested.s) > 0 {
		var key string
		var value any

		if key, err = nested.shortstr(); err != nil {
			return
		}

		if value, err = nested.field(depth); err != nil {
			return
		}

		if len(table) >= maxContainerElements {
			return nil, errTooMany
		}

		table[key] = value
	}

	return
}

func readArray(r io.Reader) (arr []any, err error) {
	return readArrayDepth(r, 0)
}

// readArrayDepth reads an array from r (onceler: from its length on; used
// by upstream's tests).
func readArrayDepth(r io.Reader, depth int) (arr []any, err error) {
	b, err := io.ReadAll(r)
	if err != nil {
		return nil, err
	}
	return (&strReader{s: string(b)}).array(depth)
}

// array reads an array: its length in bytes, then its fields.
func (r *strReader) array(depth int) (arr []any, err error) {
	if depth > maxFieldDepth {
		return nil, errTooDeep
	}

	size, err := r.u32()
	if err != nil {
		return nil, err
	}

	// size is the encoded blob's byte length, not the element count of arr.
	// Cap it like readLongstr's length to reject clearly invalid values.
	if size > math.MaxInt32 {
		return nil, ErrSyntax
	}

	n := min(int(size), len(r.s))
	lim := strReader{s: r.s[:n]}
	r.s = r.s[n:]

	for {
		field, err := lim.field(depth)
		if err != nil {
			if err == io.EOF {
				break
			}
			return nil, err
		}

		if len(arr) >= maxContainerElements {
			return nil, errTooMany
		}

		arr = append(arr, field)
	}

	return arr, nil
}

// onceler: in place of ErrSyntax, the limits and the unknown field type say
// which rule the table broke.
var (
	errTooDeep = fmt.Errorf("tables or arrays nested deeper than %d", maxFieldDepth)
	errTooMany = fmt.Errorf("a table or array with more than %d entries", maxContainerElements)
)

// readContentHeaders reads the headers property of a content header frame.
// (onceler) A table whose bytes arrived whole but that the reader refuses
// (too deep, too many entries, an unknown field type, an inner length that
// overruns it) costs the message its headers, not the connection: headers
// is then nil and unreadable says why, and the message is delivered so
// that its consumer can settle it. The table's length prefix keeps the
// frame in step, so the properties after it are read as usual. err is
// non-nil only when the frame itself is broken.
func readContentHeaders(r *strReader) (headers Table, unreadable error, err error) {
	var str string
	if str, err = r.longstr(); err != nil {
		return nil, nil, err
	}
	if headers, err = parseTableDepth(str, 0); err != nil {
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return nil, &HeadersError{Size: len(str), Err: err}, nil
	}
	return headers, nil, nil
}

// HeadersError says why a delivery's header table could not be read
// (onceler).
type HeadersError struct {
	// Size is the length of the table in bytes.
	Size int
	// Err is the reader's refusal.
	Err error
}

// Error implements error.
func (e *HeadersError) Error() string {
	return fmt.Sprintf("header table of %d bytes unreadable: %v", e.Size, e.Err)
}

// Unwrap returns the reader's refusal.
func (e *HeadersError) Unwrap() error { return e.Err }

// Checks if this bit mask matches the flags bitset
func hasProperty(mask uint16, prop int) bool {
	return int(mask)&prop > 0
}

func (r *reader) parseHeaderFrame(channel uint16, size uint32) (frame frame, err error) {
	hf := &headerFrame{
		ChannelId: channel,
	}

	// onceler: the payload is read whole and its properties parsed from it
	// in place: string properties, header keys and string header values are
	// substrings of it, not copies.
	payload, err := readBytes(r.r, int64(size))
	if err != nil {
		return nil, err
	}
	lim := &strReader{s: bytesString(payload)}

	if hf.ClassId, err = lim.u16(); err != nil {
		return
	}

	if hf.weight, err = lim.u16(); err != nil {
		return
	}

	if hf.Size, err = lim.u64(); err != nil {
		return
	}

	var flags uint16

	if flags, err = lim.u16(); err != nil {
		return
	}

	if hasProperty(flags, flagContentType) {
		if hf.Properties.ContentType, err = lim.shortstr(); err != nil {
			return
		}
	}
	if hasProperty(flags, flagContentEncoding) {
		if hf.Properties.ContentEncoding, err = lim.shortstr(); err != nil {
			return
		}
	}
	if hasProperty(flags, flagHeaders) {
		if hf.Properties.Headers, hf.Properties.headersErr, err = readContentHeaders(lim); err != nil {
			return
		}
	}
	if hasProperty(flags, flagDeliveryMode) {
		if hf.Properties.DeliveryMode, err = lim.u8(); err != nil {
			return
		}
	}
	if hasProperty(flags, flagPriority) {
		if hf.Properties.Priority, err = lim.u8(); err != nil {
			return
		}
	}
	if hasProperty(flags, flagCorrelationId) {
		if hf.Properties.CorrelationId, err = lim.shortstr(); err != nil {
			return
		}
	}
	if hasProperty(flags, flagReplyTo) {
		if hf.Properties.ReplyTo, err = lim.shortstr(); err != nil {
			return
		}
	}
	if hasProperty(flags, flagExpiration) {
		if hf.Properties.Expiration, err = lim.shortstr(); err != nil {
			return
		}
	}
	if hasProperty(flags, flagMessageId) {
		if hf.Properties.MessageId, err = lim.shortstr(); err != nil {
			return
		}
	}
	if hasProperty(flags, flagTimestamp) {
		if hf.Properties.Timestamp, err = lim.timestamp(); err != nil {
			return
		}
	}
	if hasProperty(flags, flagType) {
		if hf.Properties.Type, err = lim.shortstr(); err != nil {
			return
		}
	}
	if hasProperty(flags, flagUserId) {
		if hf.Properties.UserId, err = lim.shortstr(); err != nil {
			return
		}
	}
	if hasProperty(flags, flagAppId) {
		if hf.Properties.AppId, err = lim.shortstr(); err != nil {
			return
		}
	}
	if hasProperty(flags, flagReserved1) {
		if hf.Properties.reserved1, err = lim.shortstr(); err != nil {
			return
		}
	}

	// Any bytes remaining in the frame payload that were not consumed by
	// property parsing (e.g. padding added by other AMQP implementations)
	// were read with it.

	return hf, nil
}

func (r *reader) parseBodyFrame(channel uint16, size uint32) (frame frame, err error) {
	bf := &bodyFrame{
		ChannelId: channel,
	}

	if bf.Body, err = readBytes(r.r, int64(size)); err != nil {
		return nil, err
	}

	return bf, nil
}

var errHeartbeatPayload = errors.New("heartbeats should not have a payload")
var errHeartbeatChannel = errors.New("heartbeats must be sent on channel 0")

func (r *reader) parseHeartbeatFrame(channel uint16, size uint32) (frame frame, err error) {
	// Per the AMQP 0-9-1 spec, heartbeats are only ever sent on channel 0.
	if channel != 0 {
		return nil, errHeartbeatChannel
	}

	hf := &heartbeatFrame{
		ChannelId: channel,
	}

	if size > 0 {
		return nil, errHeartbeatPayload
	}

	return hf, nil
}
