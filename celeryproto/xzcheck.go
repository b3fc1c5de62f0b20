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
	const hdr = 12
	if len(body) < 2*hdr || string(body[:6]) != "\xfd7zXZ\x00" || string(body[len(body)-2:]) != "YZ" {
		return fmt.Errorf("%w: not a single xz stream", errXZ)
	}
	footer := body[len(body)-hdr:]
	indexSize := (int(binary.LittleEndian.Uint32(footer[4:8])) + 1) * 4
	indexStart := len(body) - hdr - indexSize
	if indexStart < hdr {
		return fmt.Errorf("%w: bad index size", errXZ)
	}
	idx := body[indexStart : len(body)-hdr]
	if idx[0] != 0 {
		return fmt.Errorf("%w: bad index indicator", errXZ)
	}
	pos := 1
	records, ok := xzVarint(idx, &pos)
	if !ok || records > uint64(len(idx)) {
		return fmt.Errorf("%w: bad index", errXZ)
	}
	blockStart := hdr
	var total uint64
	for range records {
		unpadded, ok1 := xzVarint(idx, &pos)
		uncompressed, ok2 := xzVarint(idx, &pos)
		if !ok1 || !ok2 || unpadded > uint64(len(body)) {
			return fmt.Errorf("%w: bad index record", errXZ)
		}
		total += uncompressed
		if total > uint64(limit) {
			return decodeErr(ErrTooLarge, nil, "xz body declares more than %d bytes", limit)
		}
		if err := checkXZBlock(body, blockStart, indexStart); err != nil {
			return err
		}
		blockStart += int((unpadded + 3) &^ 3)
		if blockStart > indexStart {
			return fmt.Errorf("%w: blocks overrun the index", errXZ)
		}
	}
	if blockStart != indexStart {
		return fmt.Errorf("%w: not a single xz stream", errXZ)
	}
	return nil
}

func checkXZBlock(body []byte, start, end int) error {
	if start >= end {
		return fmt.Errorf("%w: block outside the stream", errXZ)
	}
	size := (int(body[start]) + 1) * 4
	if body[start] == 0 || start+size > end {
		return fmt.Errorf("%w: bad block header", errXZ)
	}
	h := body[start : start+size]
	flags := h[1]
	pos := 2
	for _, bit := range []byte{0x40, 0x80} {
		if flags&bit != 0 {
			if _, ok := xzVarint(h, &pos); !ok {
				return fmt.Errorf("%w: bad block header", errXZ)
			}
		}
	}
	for range int(flags&3) + 1 {
		id, ok1 := xzVarint(h, &pos)
		n, ok2 := xzVarint(h, &pos)
		if !ok1 || !ok2 || uint64(len(h)-pos) < n {
			return fmt.Errorf("%w: bad filter flags", errXZ)
		}
		if id == 0x21 && n == 1 {
			if dict := xzDictSize(h[pos]); dict > maxXZDict {
				return decodeErr(ErrTooLarge, nil, "xz body declares a %d-byte dictionary (limit %d)", dict, maxXZDict)
			}
		}
		pos += int(n)
	}
	return nil
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
