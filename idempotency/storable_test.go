package idempotency_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/idempotency"
)

func TestStorableJSON(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ in, want string }{
		{`{"a": 1}`, `{"a": 1}`},
		{`"\u0000"`, `"\\u0000"`},
		{`["x\u0000y", "\\u0000", "\u0001"]`, `["x\\u0000y", "\\u0000", "\u0001"]`},
		{`"\ud800"`, `"\\ud800"`},
		{`"\udc00x"`, `"\\udc00x"`},
		{`"\ud83d\ude00"`, `"\ud83d\ude00"`},
		{`"\ud83d\u0041"`, `"\\ud83d\u0041"`},
		{"\"a\xffb\"", `"a\ufffdb"`},
		{`{"k\u0000": "\u003c"}`, `{"k\\u0000": "\u003c"}`},
	} {
		got, err := idempotency.StorableJSON([]byte(c.in))
		if err != nil || string(got) != c.want {
			t.Errorf("StorableJSON(%q) = %q, %v; want %q", c.in, got, err, c.want)
		}
		if !json.Valid(got) {
			t.Errorf("StorableJSON(%q) = %q: not JSON", c.in, got)
		}
	}
	if _, err := idempotency.StorableJSON([]byte(`{"a":`)); err == nil {
		t.Error("accepted a document that is not JSON")
	}
	if got := idempotency.StorableText("a\x00b\xffc"); got != `a\u0000b`+"\uFFFD"+`c` {
		t.Errorf("StorableText = %q", got)
	}
}

// TestUnstorableOutcomesAreStored: a result with NUL, an unpaired surrogate
// or bytes that are not UTF-8, and an error text with NUL or invalid UTF-8,
// all of which PostgreSQL refuses as they are, are stored (escaped) at
// once; a claim with a key beyond MaxKeyBytes is refused before it is sent,
// as definite.
func TestUnstorableOutcomesAreStored(t *testing.T) {
	t.Parallel()
	e := newEnv(t, idempotency.BatchConfig{})
	ctx := context.Background()
	for i, res := range []string{`{"v": "\u0000"}`, `"\ud800"`, "\"\xff\""} {
		p := params("unstorable", "r"+string(rune('0'+i)))
		c, err := e.store.Claim(ctx, p)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := e.store.Complete(ctx, p.Ref(c.Token), []byte(res)); err != nil {
			t.Fatalf("complete %q: %v", res, err)
		}
		if r := e.get(t, "unstorable", p.Key); r.Status != idempotency.StatusCompleted {
			t.Fatalf("record of %q: %v", res, r.Status)
		}
	}
	p := params("unstorable", "fail")
	c, err := e.store.Claim(ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.store.Fail(ctx, p.Ref(c.Token), "boom\x00\xfe"); err != nil {
		t.Fatalf("fail: %v", err)
	}
	if r := e.get(t, "unstorable", "fail"); r.Status != idempotency.StatusFailed || !strings.HasPrefix(r.Error, `boom\u0000`) {
		t.Fatalf("failed record %+v", r)
	}
	_, err = e.store.Claim(ctx, params("unstorable", strings.Repeat("k", idempotency.MaxKeyBytes+1)))
	if !idempotency.IsDefinite(err) {
		t.Fatalf("long key: %v", err)
	}
	if _, err := e.store.Claim(ctx, params("unstorable", strings.Repeat("k", idempotency.MaxKeyBytes))); err != nil {
		t.Fatalf("key of MaxKeyBytes: %v", err)
	}
}

// TestStoredResultReturned: Complete and RunTx (alone, batched, in a
// transaction group) return the result as the record keeps it, so that a
// worker answers its caller with what a duplicate reads back.
func TestStoredResultReturned(t *testing.T) {
	t.Parallel()
	const in, want = `{"v": "a\u0000b"}`, `{"v": "a\\u0000b"}`
	for name, batch := range map[string]idempotency.BatchConfig{
		"solo": {Disabled: true}, "batched": {}, "group": {GroupTx: 4, GroupFlushers: 1},
	} {
		t.Run(name, func(t *testing.T) {
			e := newEnv(t, batch)
			ctx := context.Background()
			p := params("stored", "complete")
			c, err := e.store.Claim(ctx, p)
			if err != nil {
				t.Fatal(err)
			}
			stored, err := e.store.Complete(ctx, p.Ref(c.Token), []byte(in))
			if err != nil || string(stored) != want {
				t.Fatalf("Complete = %q, %v; want %q", stored, err, want)
			}
			if r := e.get(t, "stored", "complete"); !jsonSame(t, r.Result, stored) {
				t.Errorf("record keeps %s, Complete returned %s", r.Result, stored)
			}
			c, err = e.store.RunTx(ctx, params("stored", "runtx"), func(context.Context, pgx.Tx) ([]byte, error) {
				return []byte(in), nil
			})
			if err != nil || string(c.Result) != want {
				t.Fatalf("RunTx result = %q, %v; want %q", c.Result, err, want)
			}
			if r := e.get(t, "stored", "runtx"); !jsonSame(t, r.Result, c.Result) {
				t.Errorf("record keeps %s, RunTx returned %s", r.Result, c.Result)
			}
		})
	}
}

// jsonSame reports whether two JSON documents hold the same value.
func jsonSame(t *testing.T, a, b []byte) bool {
	t.Helper()
	var va, vb any
	if err := json.Unmarshal(a, &va); err != nil {
		t.Fatalf("%q: %v", a, err)
	}
	if err := json.Unmarshal(b, &vb); err != nil {
		t.Fatalf("%q: %v", b, err)
	}
	ja, _ := json.Marshal(va)
	jb, _ := json.Marshal(vb)
	return string(ja) == string(jb)
}
