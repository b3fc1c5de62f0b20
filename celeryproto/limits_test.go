package celeryproto

import (
	"bytes"
	"encoding/binary"
	"errors"
	"runtime"
	"strings"
	"testing"
)

// msgpackEmptyMaps is a protocol 2 msgpack body whose args are n empty
// maps: one byte each, tens of bytes of Go heap each once decoded.
func msgpackEmptyMaps(n int) []byte {
	var b bytes.Buffer
	b.WriteByte(0x93) // [args, kwargs, embed]
	b.WriteByte(0xdd) // array 32
	_ = binary.Write(&b, binary.BigEndian, uint32(n))
	b.Write(bytes.Repeat([]byte{0x80}, n))
	b.WriteByte(0x80) // kwargs {}
	b.WriteByte(0xc0) // embed nil
	return b.Bytes()
}

func msgpackDelivery(body []byte) *Delivery {
	return &Delivery{ContentType: ContentTypeMsgpack, ContentEncoding: "binary", Headers: v2Headers(), Body: body}
}

// allocated runs f and returns the bytes it allocated on the heap.
func allocated(f func()) uint64 {
	var a, b runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&a)
	f()
	runtime.ReadMemStats(&b)
	return b.TotalAlloc - a.TotalAlloc
}

func TestDecodeBoundsElements(t *testing.T) {
	cases := []struct {
		name   string
		limits Limits
		d      *Delivery
	}{
		{"msgpack empty maps", Limits{}, msgpackDelivery(msgpackEmptyMaps(4 << 20))},
		{"msgpack declared array", Limits{}, msgpackDelivery(append(msgpackEmptyMaps(4 << 20)[:6], bytes.Repeat([]byte{0xc0}, 4<<20)...))},
		{"json empty objects", Limits{}, jsonDelivery("[["+strings.Repeat("{},", 3<<20)+"{}], {}, null]", v2Headers())},
		{"yaml empty maps", Limits{MaxElements: 100000}, &Delivery{ContentType: ContentTypeYAML, Headers: v2Headers(),
			Body: []byte("[[" + strings.Repeat("{},", (1<<20)/3-10) + "{}], {}, null]")}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dec := NewDecoder(c.limits)
			var err error
			n := allocated(func() { _, err = dec.Decode(c.d) })
			if !errors.Is(err, ErrTooLarge) {
				t.Fatalf("Decode: %v, want ErrTooLarge", err)
			}
			// The body is at most 9 MiB; decoded without a bound it takes
			// hundreds of MiB (3 or 4 Mi maps at 64 bytes and more each).
			if c.name != "yaml empty maps" && n > 160<<20 {
				t.Errorf("decode allocated %d MiB before refusing", n>>20)
			}
		})
	}
}

func TestDecodeBoundsDecodedBytes(t *testing.T) {
	t.Parallel()
	dec := NewDecoder(Limits{MaxDecodedBytes: 1 << 20})
	big := strings.Repeat("x", 2<<20)
	_, err := dec.Decode(jsonDelivery(`[["`+big+`"], {}, null]`, v2Headers()))
	if !errors.Is(err, ErrTooLarge) || !strings.Contains(err.Error(), "bytes") {
		t.Fatalf("2 MiB string under a 1 MiB decoded limit: %v, want ErrTooLarge naming bytes", err)
	}
	m, cost, err := dec.DecodeCost(jsonDelivery(`[["`+big[:256<<10]+`"], {}, null]`, v2Headers()))
	if err != nil {
		t.Fatalf("256 KiB string: %v", err)
	}
	if len(m.Args) != 1 || cost < 256<<10 || cost > 300<<10 {
		t.Errorf("cost %d for a 256 KiB string, want about 256 KiB", cost)
	}
}

// TestEstimateBoundsDecode checks that Estimate is at least what a decode
// costs, and small for small messages.
func TestEstimateBoundsDecode(t *testing.T) {
	dec := NewDecoder(Limits{})
	small := jsonDelivery(`[[1, 2], {}, {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]`, v2Headers())
	if e := dec.Estimate(small); e > 8<<10 {
		t.Errorf("estimate of a %d-byte message: %d", len(small.Body), e)
	}
	_, cost, err := dec.DecodeCost(small)
	if err != nil {
		t.Fatal(err)
	}
	if e := dec.Estimate(small); cost > e {
		t.Errorf("cost %d above the estimate %d", cost, e)
	}
	maps := msgpackDelivery(msgpackEmptyMaps(100000))
	_, cost, err = dec.DecodeCost(maps)
	if err != nil {
		t.Fatal(err)
	}
	if e := dec.Estimate(maps); cost > e {
		t.Errorf("msgpack maps: cost %d above the estimate %d", cost, e)
	}

	// A zstd bomb: the estimate covers its declared output and window and is
	// bounded by the limits, not by its 16 MiB of output times the cost per
	// element.
	kind, z, err := compress("zstd", msgpackEmptyMaps(16<<20-16))
	if err != nil {
		t.Fatal(err)
	}
	h := v2Headers()
	h["compression"] = kind
	bomb := &Delivery{ContentType: ContentTypeMsgpack, Headers: h, Body: z}
	e := dec.Estimate(bomb)
	if e < 32<<20 || e > 200<<20 {
		t.Errorf("zstd bomb of %d bytes: estimate %d MiB, want 32..200 MiB", len(z), e>>20)
	}
	var derr error
	n := allocated(func() { _, derr = dec.Decode(bomb) })
	if !errors.Is(derr, ErrTooLarge) {
		t.Fatalf("zstd bomb: %v, want ErrTooLarge", derr)
	}
	if n > uint64(e) {
		t.Errorf("zstd bomb allocated %d MiB, above its estimate %d MiB", n>>20, e>>20)
	}
}
