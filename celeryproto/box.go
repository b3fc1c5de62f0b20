package celeryproto

import "unsafe"

// boxer puts decoded scalars into interface values without one heap
// allocation each. Converting a string, int64 or float64 to `any` copies it
// to the heap; the decoder instead stores the value in a slab (one
// allocation per slabSize values) and makes the interface point at its slot.
// A slot is written once, before its interface exists, and never again, so
// the interface sees an immutable value exactly as with an ordinary
// conversion; the slab stays alive as long as any interface points into it.
type boxer struct {
	// first scales the first slab of each kind (slabSize: full size; 0 is
	// slabSize): a small message's values fit in small slabs.
	first  int
	strs   []string
	ints   []int64
	floats []float64
	slices [][]any
	chunk  []any
}

const slabSize = 32

// eface is the runtime layout of an empty interface.
type eface struct {
	typ, data unsafe.Pointer
}

func withData(x any, p unsafe.Pointer) any {
	(*eface)(unsafe.Pointer(&x)).data = p
	return x
}

func (b *boxer) str(s string) any {
	if s == "" {
		return ""
	}
	if len(b.strs) == cap(b.strs) {
		b.strs = make([]string, 0, b.size(cap(b.strs), slabSize))
	}
	b.strs = append(b.strs, s)
	return withData("", unsafe.Pointer(&b.strs[len(b.strs)-1]))
}

func (b *boxer) int(n int64) any {
	if n >= 0 && n < 256 {
		return n // the runtime boxes small values without allocating
	}
	if len(b.ints) == cap(b.ints) {
		b.ints = make([]int64, 0, b.size(cap(b.ints), slabSize))
	}
	b.ints = append(b.ints, n)
	return withData(int64(0), unsafe.Pointer(&b.ints[len(b.ints)-1]))
}

func (b *boxer) float(f float64) any {
	if len(b.floats) == cap(b.floats) {
		b.floats = make([]float64, 0, b.size(cap(b.floats), slabSize/2))
	}
	b.floats = append(b.floats, f)
	return withData(float64(0), unsafe.Pointer(&b.floats[len(b.floats)-1]))
}

// slice returns a copy of vals as an interface holding a []any. The backing
// arrays of all slices come from shared chunks (each slice has cap == len,
// so an append by the caller copies), and the slice headers from a slab.
func (b *boxer) slice(vals []any) any {
	n := len(vals)
	if n > slabSize {
		s := append([]any(nil), vals...)
		return b.sliceHeader(s)
	}
	if b.chunk == nil || cap(b.chunk)-len(b.chunk) < n {
		b.chunk = make([]any, 0, max(n, b.size(cap(b.chunk), 2*slabSize)))
	}
	start := len(b.chunk)
	b.chunk = append(b.chunk, vals...)
	return b.sliceHeader(b.chunk[start : start+n : start+n])
}

func (b *boxer) sliceHeader(s []any) any {
	if len(b.slices) == cap(b.slices) {
		b.slices = make([][]any, 0, b.size(cap(b.slices), slabSize/2))
	}
	b.slices = append(b.slices, s)
	return withData([]any(nil), unsafe.Pointer(&b.slices[len(b.slices)-1]))
}

// size is the size of a slab after one of size last (0: none yet): the
// first scaled by first, then doubling up to most.
func (b *boxer) size(last, most int) int {
	if last > 0 {
		return min(most, 2*last)
	}
	if b.first <= 0 || b.first >= slabSize {
		return most
	}
	return max(4, most*b.first/slabSize)
}
