package celeryproto

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// maxXZDict is the largest LZMA2 dictionary an xz body may declare. The xz
// reader allocates the declared dictionary up front (up to 4 GiB from a
// 72-byte body), so the declaration is checked before decoding. Python's
// lzma presets use at most 64 MiB.
const maxXZDict = 64 << 20

var errXZ = errors.New("xz")

// checkXZ walks the xz container of body without decompressing: it must be
// exactly one stream, every block's LZMA2 dictionary at most maxXZDict, and
// the uncompressed sizes the index declares at most limit in total.
func checkXZ(body []byte, limit int) error {
	_, _, err := xzSizes(body, limit)
	return err
}

// xzSizes is checkXZ, returning also the largest dictionary the blocks
// declare and the uncompressed size the index declares, in bytes.
func xzSizes(body []byte, limit int) (dict, total uint64, err error) {
	const hdr = 12
	if len(body) < 2*hdr || string(body[:6]) != "\xfd7zXZ\x00" || string(body[len(body)-2:]) != "YZ" {
		return 0, 0, fmt.Errorf("%w: not a single xz stream", errXZ)
	}
	footer := body[len(body)-hdr:]
	indexSize := (int(binary.LittleEndian.Uint32(footer[4:8])) + 1) * 4
	indexStart := len(body) - hdr - indexSize
	if indexStart < hdr {
		return 0, 0, fmt.Errorf("%w: bad index size", errXZ)
	}
	idx := body[indexStart : len(body)-hdr]
	if idx[0] != 0 {
		return 0, 0, fmt.Errorf("%w: bad index indicator", errXZ)
	}
	pos := 1
	records, ok := xzVarint(idx, &pos)
	if !ok || records > uint64(len(idx)) {
		return 0, 0, fmt.Errorf("%w: bad index", errXZ)
	}
	// The check after each block: its size by the stream flags' check type
	// (none, CRC32, CRC64, SHA-256 and the reserved ones).
	checkSize := [16]int{0, 4, 4, 4, 8, 8, 8, 16, 16, 16, 32, 32, 32, 64, 64, 64}[body[7]&0x0f]
	blockStart := hdr
	for range records {
		unpadded, ok1 := xzVarint(idx, &pos)
		uncompressed, ok2 := xzVarint(idx, &pos)
		if !ok1 || !ok2 || unpadded > uint64(len(body)) {
			return 0, 0, fmt.Errorf("%w: bad index record", errXZ)
		}
		total += uncompressed
		if total > uint64(limit) {
			return 0, 0, decodeErr(ErrTooLarge, nil, "xz body declares more than %d bytes", limit)
		}
		d, err := checkXZBlock(body, blockStart, indexStart, unpadded, checkSize)
		if err != nil {
			return 0, 0, err
		}
		dict = max(dict, d)
		blockStart += int((unpadded + 3) &^ 3)
		if blockStart > indexStart {
			return 0, 0, fmt.Errorf("%w: blocks overrun the index", errXZ)
		}
	}
	if blockStart != indexStart {
		return 0, 0, fmt.Errorf("%w: not a single xz stream", errXZ)
	}
	return dict, total, nil
}

// checkXZBlock checks the block at start (before end): its LZMA2
// dictionary, and that its LZMA2 chunks, walked by their headers without
// decompressing, end where the index says the block ends (unpadded: header,
// compressed data and check), so that no block hides inside another one
// where the walk by the index would not see its dictionary.
func checkXZBlock(body []byte, start, end int, unpadded uint64, checkSize int) (dict uint64, err error) {
	if start >= end {
		return 0, fmt.Errorf("%w: block outside the stream", errXZ)
	}
	size := (int(body[start]) + 1) * 4
	if body[start] == 0 || start+size > end {
		return 0, fmt.Errorf("%w: bad block header", errXZ)
	}
	h := body[start : start+size]
	flags := h[1]
	pos := 2
	for _, bit := range []byte{0x40, 0x80} {
		if flags&bit != 0 {
			if _, ok := xzVarint(h, &pos); !ok {
				return 0, fmt.Errorf("%w: bad block header", errXZ)
			}
		}
	}
	var last uint64
	for range int(flags&3) + 1 {
		id, ok1 := xzVarint(h, &pos)
		n, ok2 := xzVarint(h, &pos)
		if !ok1 || !ok2 || uint64(len(h)-pos) < n {
			return 0, fmt.Errorf("%w: bad filter flags", errXZ)
		}
		if id == 0x21 && n == 1 {
			if dict = xzDictSize(h[pos]); dict > maxXZDict {
				return 0, decodeErr(ErrTooLarge, nil, "xz body declares a %d-byte dictionary (limit %d)", dict, maxXZDict)
			}
		}
		last = id
		pos += int(n)
	}
	if last != 0x21 {
		return 0, fmt.Errorf("%w: the last filter is not LZMA2", errXZ)
	}
	p := start + size
	for {
		if p >= end {
			return 0, fmt.Errorf("%w: LZMA2 data runs past its block", errXZ)
		}
		c := body[p]
		p++
		switch {
		case c == 0x00: // end of the LZMA2 data
			if uint64(p-start+checkSize) != unpadded {
				return 0, fmt.Errorf("%w: a block's size differs from the index", errXZ)
			}
			return dict, nil
		case c == 0x01 || c == 0x02: // uncompressed chunk: 2-byte size - 1
			if p+2 > end {
				return 0, fmt.Errorf("%w: bad LZMA2 chunk", errXZ)
			}
			p += 2 + int(binary.BigEndian.Uint16(body[p:])) + 1
		case c >= 0x80: // LZMA chunk: unpacked size, packed size - 1, properties from 0xC0
			if p+4 > end {
				return 0, fmt.Errorf("%w: bad LZMA2 chunk", errXZ)
			}
			packed := int(binary.BigEndian.Uint16(body[p+2:])) + 1
			p += 4 + packed
			if c >= 0xC0 {
				p++
			}
		default:
			return 0, fmt.Errorf("%w: bad LZMA2 control byte %#x", errXZ, c)
		}
	}
}

func xzDictSize(b byte) uint64 {
	if b >= 40 {
		return 1<<32 - 1
	}
	return uint64(2|b&1) << (b/2 + 11)
}

func xzVarint(b []byte, pos *int) (uint64, bool) {
	var v uint64
	for i := 0; i < 9; i++ {
		if *pos >= len(b) {
			return 0, false
		}
		c := b[*pos]
		*pos++
		v |= uint64(c&0x7f) << (7 * i)
		if c&0x80 == 0 {
			return v, true
		}
	}
	return 0, false
}
