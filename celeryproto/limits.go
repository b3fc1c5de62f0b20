package celeryproto

import (
	"github.com/klauspost/compress/zstd"
)

// ElementCost is the Go heap a decoded value is charged besides the bytes
// of its text: the slot that holds it in its list or mapping (16 bytes) and
// its own header (an empty mapping takes 48), rounded up. A one-byte
// msgpack empty map decodes to about this much.
const ElementCost = 64

// mapGroupCost is charged once for a mapping with entries: Go allocates
// its slots in groups of eight (a key and a value of 16 bytes each).
const mapGroupCost = 8*32 + 8

// Defaults of Limits.
const (
	// DefaultMaxDecodedBytes is the default Limits.MaxDecodedBytes.
	DefaultMaxDecodedBytes = 64 << 20
	// DefaultMaxElements is the default Limits.MaxElements.
	DefaultMaxElements = 1 << 20
)

// Worst-case decoded cost per byte of serialized input, for Estimate: the
// smallest mapping with an entry (msgpack 81 a0 00, JSON {"":0}) charged
// as decoded, plus the text itself; YAML also builds a node tree of about
// a hundred bytes per input byte before it decodes.
const (
	costPerByteJSON    = (3*ElementCost+mapGroupCost)/6 + 2
	costPerByteMsgpack = (3*ElementCost+mapGroupCost)/3 + 1
	costPerByteYAML    = 160
)

// Decompressor state besides its window, generously: bzip2's tables at
// level 9, brotli's largest window.
const (
	stateBzip2  = 8 << 20
	stateBrotli = 16<<20 + 1<<20
	stateZlib   = 64 << 10
)

// meter counts the elements and bytes of one decode against its Limits.
// A nil meter counts nothing.
type meter struct {
	elems, bytes       int64
	maxElems, maxBytes int64
}

func newMeter(l Limits) *meter {
	return &meter{maxElems: int64(l.MaxElements), maxBytes: int64(l.MaxDecodedBytes)}
}

// charge adds elems elements and n bytes of text; it fails with ErrTooLarge
// past a limit.
func (m *meter) charge(elems, n int) error {
	if m == nil {
		return nil
	}
	m.elems += int64(elems)
	m.bytes += int64(elems)*ElementCost + int64(n)
	return m.check(0)
}

// fits fails with ErrTooLarge when elems more elements would pass a limit;
// it charges nothing (the elements are charged as they are decoded). It
// guards allocations sized by a declared count.
func (m *meter) fits(elems int) error {
	if m == nil {
		return nil
	}
	return m.check(int64(elems))
}

func (m *meter) check(more int64) error {
	if e := m.elems + more; e > m.maxElems {
		return decodeErr(ErrTooLarge, nil, "body decodes to more than %d elements", m.maxElems)
	}
	if b := m.bytes + more*ElementCost; b > m.maxBytes {
		return decodeErr(ErrTooLarge, nil, "body decodes to more than %d bytes (%d bytes charged per element)", m.maxBytes, ElementCost)
	}
	return nil
}

// chargeTree charges every element of a decoded value (YAML, whose parser
// is not metered while it runs).
func (m *meter) chargeTree(v any) error {
	switch x := v.(type) {
	case string:
		return m.charge(1, len(x))
	case []byte:
		return m.charge(1, len(x))
	case []any:
		if err := m.charge(1, 0); err != nil {
			return err
		}
		for _, e := range x {
			if err := m.chargeTree(e); err != nil {
				return err
			}
		}
		return nil
	case map[string]any:
		group := 0
		if len(x) > 0 {
			group = mapGroupCost
		}
		if err := m.charge(1, group); err != nil {
			return err
		}
		for k, e := range x {
			if err := m.charge(1, len(k)); err != nil {
				return err
			}
			if err := m.chargeTree(e); err != nil {
				return err
			}
		}
		return nil
	default:
		return m.charge(1, 0)
	}
}

// Estimate returns an upper bound of the memory that decoding d takes at
// its peak, in bytes, without decoding it: the body, the decompressor's
// window (as declared, where the format declares it), the decompressed body
// (its declared size, else Limits.MaxBodyBytes) twice over while it grows,
// and the decoded values (a cost per byte of input for the serializer, at
// most Limits.MaxDecodedBytes, which the decoder enforces). A body the
// decoder refuses at once (too large, pickle, an unknown content type or
// compression) is estimated at its own size.
func (dec *Decoder) Estimate(d *Delivery) int64 {
	if d == nil {
		return 0
	}
	raw := int64(len(d.Body))
	if raw > int64(dec.limits.MaxBodyBytes) {
		return raw
	}
	ser, err := serializerFor(d.ContentType)
	if err != nil {
		return raw
	}
	size, state := raw, int64(0)
	if c, ok := d.Headers["compression"].(string); ok && c != "" {
		kind, ok := compressionFor(c)
		if !ok {
			return raw
		}
		limit := int64(dec.limits.MaxBodyBytes)
		size = limit
		switch kind {
		case CompressionZlib:
			state = stateZlib
		case CompressionBzip2:
			state = stateBzip2
		case CompressionBrotli:
			state = stateBrotli
		case CompressionXZ:
			state = maxXZDict
			if dict, total, err := xzSizes(d.Body, dec.limits.MaxBodyBytes); err == nil {
				// As the body declares them (the decoder checks the
				// declarations before it decompresses).
				state, size = int64(dict), min(size, int64(total))
			}
		case CompressionZstd:
			state = int64(max(limit+1<<20, maxXZDict))
			var h zstd.Header
			if h.Decode(d.Body) == nil {
				if h.HasFCS && int64(h.FrameContentSize) < size {
					size = int64(h.FrameContentSize)
				}
				if h.SingleSegment {
					state = size
				} else if h.WindowSize > 0 && int64(h.WindowSize) < state {
					state = int64(h.WindowSize)
				}
			}
		}
		state += 2 * size // io.ReadAll doubles its buffer as it reads
	}
	var decoded int64
	switch ser {
	case "yaml":
		decoded = costPerByteYAML * min(size, maxYAMLBody)
	case "msgpack":
		decoded = min(costPerByteMsgpack*size, int64(dec.limits.MaxDecodedBytes)+ElementCost)
	default:
		decoded = min(costPerByteJSON*size, int64(dec.limits.MaxDecodedBytes)+ElementCost)
	}
	return raw + state + decoded
}
