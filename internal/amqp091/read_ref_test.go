package amqp091

// The table reader as upstream wrote it (over io.Reader, bytes.Buffer and
// binary.Read), kept to check that the in-place reader of read.go reads
// every table, and refuses every broken one, alike.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"reflect"
	"testing"
	"time"
)

func ref_readBytes(r io.Reader, n int64) ([]byte, error) {
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

func ref_readShortstr(r io.Reader) (v string, err error) {
	var length uint8
	if err = binary.Read(r, binary.BigEndian, &length); err != nil {
		return
	}

	bytes, err := ref_readBytes(r, int64(length))
	if err != nil {
		return
	}
	return string(bytes), nil
}

func ref_readLongstr(r io.Reader) (v string, err error) {
	var length uint32
	if err = binary.Read(r, binary.BigEndian, &length); err != nil {
		return
	}

	// slices can't be longer than max int32 value
	if length > (^uint32(0) >> 1) {
		return "", ErrSyntax
	}

	bytes, err := ref_readBytes(r, int64(length))
	if err != nil {
		return
	}
	return string(bytes), nil
}

func ref_readDecimal(r io.Reader) (v Decimal, err error) {
	if err = binary.Read(r, binary.BigEndian, &v.Scale); err != nil {
		return
	}
	if err = binary.Read(r, binary.BigEndian, &v.Value); err != nil {
		return
	}
	return
}

func ref_readTimestamp(r io.Reader) (v time.Time, err error) {
	var sec int64
	if err = binary.Read(r, binary.BigEndian, &sec); err != nil {
		return
	}
	return time.Unix(sec, 0), nil
}
func ref_readField(r io.Reader) (v any, err error) {
	return ref_readFieldDepth(r, 0)
}

func ref_readFieldDepth(r io.Reader, depth int) (v any, err error) {
	var typ byte
	if err = binary.Read(r, binary.BigEndian, &typ); err != nil {
		return
	}

	switch typ {
	case 't':
		var value uint8
		if err = binary.Read(r, binary.BigEndian, &value); err != nil {
			return
		}
		return value != 0, nil

	case 'B':
		var value [1]byte
		if _, err = io.ReadFull(r, value[0:1]); err != nil {
			return
		}
		return value[0], nil

	case 'b':
		var value int8
		if err = binary.Read(r, binary.BigEndian, &value); err != nil {
			return
		}
		return value, nil

	case 's':
		var value int16
		if err = binary.Read(r, binary.BigEndian, &value); err != nil {
			return
		}
		return value, nil

	case 'I':
		var value int32
		if err = binary.Read(r, binary.BigEndian, &value); err != nil {
			return
		}
		return value, nil

	case 'l':
		var value int64
		if err = binary.Read(r, binary.BigEndian, &value); err != nil {
			return
		}
		return value, nil

	// onceler: py-amqp, Celery's client, writes an integer beyond 32 bits
	// as 'L' holding a signed 64-bit value, and reads 'L' back the same way.
	case 'L':
		var value int64
		if err = binary.Read(r, binary.BigEndian, &value); err != nil {
			return
		}
		return value, nil

	case 'u':
		var value uint16
		if err = binary.Read(r, binary.BigEndian, &value); err != nil {
			return
		}
		return value, nil

	case 'i':
		var value uint32
		if err = binary.Read(r, binary.BigEndian, &value); err != nil {
			return
		}
		return value, nil

	case 'f':
		var value float32
		if err = binary.Read(r, binary.BigEndian, &value); err != nil {
			return
		}
		return value, nil

	case 'd':
		var value float64
		if err = binary.Read(r, binary.BigEndian, &value); err != nil {
			return
		}
		return value, nil

	case 'D':
		return ref_readDecimal(r)

	case 'S':
		return ref_readLongstr(r)

	case 'A':
		return ref_readArrayDepth(r, depth+1)

	case 'T':
		return ref_readTimestamp(r)

	case 'F':
		return ref_readTableDepth(r, depth+1)

	case 'x':
		var len int32
		if err = binary.Read(r, binary.BigEndian, &len); err != nil {
			return nil, err
		}
		if len < 0 {
			return nil, ErrSyntax
		}

		value, err := ref_readBytes(r, int64(len))
		if err != nil {
			return nil, err
		}
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
func ref_readTable(r io.Reader) (table Table, err error) {
	return ref_readTableDepth(r, 0)
}

func ref_readTableDepth(r io.Reader, depth int) (table Table, err error) {
	if depth > maxFieldDepth {
		return nil, errTooDeep
	}

	var str string

	if str, err = ref_readLongstr(r); err != nil {
		return
	}

	return ref_parseTableDepth(str, depth)
}

// parseTableDepth parses the bytes of a table, its length prefix already
// read (onceler: split from readTableDepth for readContentHeaders).
func ref_parseTableDepth(str string, depth int) (table Table, err error) {
	var nested bytes.Buffer

	nested.WriteString(str)

	table = make(Table)

	for nested.Len() > 0 {
		var key string
		var value any

		if key, err = ref_readShortstr(&nested); err != nil {
			return
		}

		if value, err = ref_readFieldDepth(&nested, depth); err != nil {
			return
		}

		if len(table) >= maxContainerElements {
			return nil, errTooMany
		}

		table[key] = value
	}

	return
}

func ref_readArray(r io.Reader) (arr []any, err error) {
	return ref_readArrayDepth(r, 0)
}

func ref_readArrayDepth(r io.Reader, depth int) (arr []any, err error) {
	if depth > maxFieldDepth {
		return nil, errTooDeep
	}

	var size uint32

	if err = binary.Read(r, binary.BigEndian, &size); err != nil {
		return nil, err
	}

	// size is the encoded blob's byte length, not the element count of arr.
	// Cap it like readLongstr's length to reject clearly invalid values.
	if size > math.MaxInt32 {
		return nil, ErrSyntax
	}

	var (
		lim   = &io.LimitedReader{R: r, N: int64(size)}
		field any
	)

	for {
		if field, err = ref_readFieldDepth(lim, depth); err != nil {
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

// randomField writes a random field (type octet and value) to b.
func randomField(rng *rand.Rand, b []byte, depth int) []byte {
	types := "tBbsIlLuifdDSATFxV"
	typ := types[rng.IntN(len(types))]
	if depth > 3 && (typ == 'A' || typ == 'F') {
		typ = 'S'
	}
	b = append(b, typ)
	switch typ {
	case 't', 'B', 'b':
		b = append(b, byte(rng.Uint32()))
	case 's', 'u':
		b = binary.BigEndian.AppendUint16(b, uint16(rng.Uint32()))
	case 'I', 'i', 'f':
		b = binary.BigEndian.AppendUint32(b, rng.Uint32())
	case 'l', 'L', 'd', 'T':
		b = binary.BigEndian.AppendUint64(b, rng.Uint64())
	case 'D':
		b = append(b, byte(rng.Uint32()))
		b = binary.BigEndian.AppendUint32(b, rng.Uint32())
	case 'S', 'x':
		s := make([]byte, rng.IntN(20))
		for i := range s {
			s[i] = byte(rng.Uint32())
		}
		b = append(b, longstr(s)...)
	case 'A':
		var inner []byte
		for range rng.IntN(4) {
			inner = randomField(rng, inner, depth+1)
		}
		b = append(b, longstr(inner)...)
	case 'F':
		b = append(b, randomTable(rng, depth+1)...)
	}
	return b
}

func randomTable(rng *rand.Rand, depth int) []byte {
	var inner []byte
	for range rng.IntN(6) {
		k := make([]byte, rng.IntN(8))
		for i := range k {
			k[i] = 'a' + byte(rng.IntN(26))
		}
		inner = append(inner, shortstr(string(k))...)
		inner = randomField(rng, inner, depth)
	}
	return longstr(inner)
}

func sameRead(t *testing.T, wire []byte) {
	t.Helper()
	want, werr := ref_readTable(bytes.NewReader(wire))
	got, gerr := readTable(bytes.NewReader(wire))
	if (werr == nil) != (gerr == nil) || (werr != nil && (werr.Error() != gerr.Error() || errors.Is(gerr, io.EOF) != errors.Is(werr, io.EOF))) {
		t.Fatalf("% x: error %v, upstream's %v", wire, gerr, werr)
	}
	if werr == nil && !reflect.DeepEqual(got, want) && fmt.Sprintf("%#v", got) != fmt.Sprintf("%#v", want) { // NaN
		t.Fatalf("% x: read %#v, upstream's %#v", wire, got, want)
	}
}

// The in-place table reader reads random tables, and random damage done to
// them (bytes changed, cut short), as upstream's reader does.
func TestReadTableAsUpstream(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for range 20000 {
		wire := randomTable(rng, 0)
		sameRead(t, wire)
		if len(wire) > 4 {
			cut := append([]byte(nil), wire...)
			cut = cut[:4+rng.IntN(len(wire)-4)]
			binary.BigEndian.PutUint32(cut, uint32(len(cut)-4))
			sameRead(t, cut)
			bad := append([]byte(nil), wire...)
			for range 1 + rng.IntN(3) {
				bad[4+rng.IntN(len(bad)-4)] = byte(rng.Uint32())
			}
			sameRead(t, bad)
		}
	}
	// Long strings cut at and off readBytes' chunks, in an array.
	for _, n := range []int{readAllocChunk, 2 * readAllocChunk, readAllocChunk + 10} {
		s := bytes.Repeat([]byte{'y'}, n)
		arr := append([]byte{'S'}, binary.BigEndian.AppendUint32(nil, uint32(n+readAllocChunk))...)
		arr = append(arr, s...)
		sameRead(t, table(entry("a", append([]byte{'A'}, longstr(arr)...))))
		sameRead(t, table(entry("s", append([]byte{'S'}, binary.BigEndian.AppendUint32(nil, uint32(n+readAllocChunk))...))))
	}
}

var _ = []any{fmt.Sprint, math.MaxInt32, time.Unix, ref_readField, ref_readArray}
