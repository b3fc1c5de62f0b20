package amqp091

import (
	"bytes"
	"testing"
)

// celeryHeaders is the header table of a Celery 5 task message, protocol 2.
func celeryHeaders() []byte {
	s := func(v string) []byte { return append([]byte{'S'}, longstr([]byte(v))...) }
	return table(
		entry("lang", s("py")),
		entry("task", s("bench.outside")),
		entry("id", s("0b5bd1ff-93a4-4d1c-9b7c-2f3e5a0d6c11")),
		entry("shadow", []byte{'V'}),
		entry("eta", []byte{'V'}),
		entry("expires", []byte{'V'}),
		entry("group", []byte{'V'}),
		entry("group_index", []byte{'V'}),
		entry("retries", []byte{'I', 0, 0, 0, 0}),
		entry("timelimit", append([]byte{'A'}, longstr([]byte{'V', 'V'})...)),
		entry("root_id", s("0b5bd1ff-93a4-4d1c-9b7c-2f3e5a0d6c11")),
		entry("parent_id", []byte{'V'}),
		entry("argsrepr", s("['op-000001']")),
		entry("kwargsrepr", s("{}")),
		entry("origin", s("gen1234@host")),
		entry("ignore_result", []byte{'t', 0}),
	)
}

func BenchmarkReadHeaderFrame(b *testing.B) {
	wire := contentHeader(celeryHeaders())
	wire = append(wire, frameHeartbeat, 0, 0, 0, 0, 0, 0, frameEnd)
	b.ReportAllocs()
	for b.Loop() {
		r := reader{r: bytes.NewReader(wire)}
		if _, err := r.ReadFrame(); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkParseTable(b *testing.B) {
	t := celeryHeaders()
	b.Run("in-place", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := readTable(bytes.NewReader(t)); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("upstream", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := ref_readTable(bytes.NewReader(t)); err != nil {
				b.Fatal(err)
			}
		}
	})
}
