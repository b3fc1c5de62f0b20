package celeryproto

import (
	"bytes"
	"compress/bzip2"
	"compress/zlib"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/andybalholm/brotli"
	"github.com/klauspost/compress/zstd"
	"github.com/ulikunitz/xz"

	"github.com/onceler/onceler/internal/clip"
)

// Compression header values, as kombu writes them.
const (
	CompressionZlib   = "application/x-gzip" // a zlib stream (RFC 1950), not gzip
	CompressionBzip2  = "application/x-bz2"
	CompressionXZ     = "application/x-lzma" // an xz container
	CompressionBrotli = "application/x-brotli"
	CompressionZstd   = "application/zstd"
)

// compressionFor maps a compression name or alias to its header value.
func compressionFor(name string) (string, bool) {
	switch strings.ToLower(strings.TrimSpace(name)) {
	case CompressionZlib, "gzip", "zlib":
		return CompressionZlib, true
	case CompressionBzip2, "bzip2", "bzip", "bz2":
		return CompressionBzip2, true
	case CompressionXZ, "lzma", "xz", "application/x-xz":
		return CompressionXZ, true
	case CompressionBrotli, "brotli", "br":
		return CompressionBrotli, true
	case CompressionZstd, "zstd", "zstandard", "application/x-zstd":
		return CompressionZstd, true
	}
	return "", false
}

// decompress reads body compressed with the given header value, refusing
// more than limit bytes of output.
func decompress(compression string, body []byte, limit int) ([]byte, error) {
	kind, ok := compressionFor(compression)
	if !ok {
		return nil, decodeErr(ErrCompression, nil, "unsupported compression %q", clip.String(compression, 100))
	}
	var r io.Reader
	src := bytes.NewReader(body)
	switch kind {
	case CompressionZlib:
		zr, err := zlib.NewReader(src)
		if err != nil {
			return nil, decodeErr(ErrCompression, err, "corrupt %s body", kind)
		}
		defer zr.Close()
		r = zr
	case CompressionBzip2:
		r = bzip2.NewReader(src)
	case CompressionXZ:
		if err := checkXZ(body, limit); err != nil {
			if IsDecodeError(err) {
				return nil, err
			}
			return nil, decodeErr(ErrCompression, err, "corrupt %s body", kind)
		}
		xr, err := xz.ReaderConfig{SingleStream: true}.NewReader(src)
		if err != nil {
			return nil, decodeErr(ErrCompression, err, "corrupt %s body", kind)
		}
		r = xr
	case CompressionBrotli:
		r = brotli.NewReader(src)
	case CompressionZstd:
		// The window (history) is allocated as declared: bound it like the
		// xz dictionary; the output itself is bounded by the limit below.
		window := uint64(max(limit+1<<20, maxXZDict))
		zr, err := zstd.NewReader(src, zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxMemory(window), zstd.WithDecoderMaxWindow(window))
		if err != nil {
			return nil, decodeErr(ErrCompression, err, "corrupt %s body", kind)
		}
		defer zr.Close()
		r = zr
	}
	out, err := io.ReadAll(io.LimitReader(r, int64(limit)+1))
	if errors.Is(err, zstd.ErrDecoderSizeExceeded) || errors.Is(err, zstd.ErrWindowSizeExceeded) {
		return nil, decodeErr(ErrTooLarge, err, "%s body needs more than %d bytes", kind, limit)
	}
	if err != nil {
		return nil, decodeErr(ErrCompression, err, "corrupt %s body", kind)
	}
	if len(out) > limit {
		return nil, decodeErr(ErrTooLarge, nil, "%s body decompresses to more than %d bytes", kind, limit)
	}
	return out, nil
}

// compress compresses body for the given compression name or alias and
// returns the header value to send with it.
func compress(name string, body []byte) (string, []byte, error) {
	kind, ok := compressionFor(name)
	if !ok {
		return "", nil, fmt.Errorf("celeryproto: unsupported compression %q", name)
	}
	var buf bytes.Buffer
	var w io.WriteCloser
	switch kind {
	case CompressionZlib:
		w = zlib.NewWriter(&buf)
	case CompressionXZ:
		xw, err := xz.NewWriter(&buf)
		if err != nil {
			return "", nil, fmt.Errorf("celeryproto: xz writer: %w", err)
		}
		w = xw
	case CompressionBrotli:
		w = brotli.NewWriter(&buf)
	case CompressionZstd:
		zw, err := zstd.NewWriter(&buf, zstd.WithEncoderConcurrency(1))
		if err != nil {
			return "", nil, fmt.Errorf("celeryproto: zstd writer: %w", err)
		}
		w = zw
	default:
		return "", nil, fmt.Errorf("celeryproto: compression %q can be decoded but not encoded (no bzip2 writer)", kind)
	}
	if _, err := w.Write(body); err != nil {
		return "", nil, fmt.Errorf("celeryproto: compress %s: %w", kind, err)
	}
	if err := w.Close(); err != nil {
		return "", nil, fmt.Errorf("celeryproto: compress %s: %w", kind, err)
	}
	return kind, buf.Bytes(), nil
}
