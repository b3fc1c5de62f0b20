package amqp091

import (
	"bytes"
	"fmt"
	"runtime"
	"testing"
)

// chains is a header table of n entries, each a chain of depth tables
// nested in one another around a string of pad bytes: every table of the
// chain is at least pad bytes long, but holds a single entry.
func chains(n, depth, pad int) []byte {
	var entries [][]byte
	for i := range n {
		t := table(entry("s", append([]byte{'S'}, longstr(bytes.Repeat([]byte{'x'}, pad))...)))
		for range depth - 1 {
			t = table(entry("t", append([]byte{'F'}, t...)))
		}
		entries = append(entries, entry(fmt.Sprintf("c%d", i), append([]byte{'F'}, t...)))
	}
	return table(entries...)
}

// heldBytes is the heap that read's result keeps alive.
func heldBytes(t *testing.T, read func() (Table, error)) uint64 {
	t.Helper()
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	tbl, err := read()
	if err != nil {
		t.Fatal(err)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	runtime.KeepAlive(tbl)
	return after.HeapAlloc - before.HeapAlloc
}

// A header table of nested single-entry tables, each long enough for its
// map to be sized for many entries, costs no more memory to hold than it
// did with upstream's reader: a message's headers are held while it waits
// for a worker, so a few such messages must not hold the heap.
func TestNestedTablesDoNotInflateTheHeap(t *testing.T) {
	wire := chains(70, maxFieldDepth, 1536) // a frame within RabbitMQ's default frame_max (131072)
	frame := contentHeader(wire)
	ref := heldBytes(t, func() (Table, error) { return ref_readTable(bytes.NewReader(wire)) })
	got := heldBytes(t, func() (Table, error) {
		hf := readHeader(t, frame)
		return hf.Properties.Headers, hf.Properties.headersErr
	})
	t.Logf("header frame of %d bytes: held %d bytes (upstream's reader: %d)", len(frame), got, ref)
	if got > 2*ref {
		t.Errorf("a %d-byte header frame holds %d bytes of heap, upstream's reader %d", len(frame), got, ref)
	}
}
