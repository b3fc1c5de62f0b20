package celeryproto

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"testing"
)

// FuzzDecode feeds arbitrary bodies, content types and compression headers
// to the decoder, seeded with the golden vectors. Every failure must be a
// *DecodeError matching exactly one sentinel, and nothing may panic.
func FuzzDecode(f *testing.F) {
	for _, v := range loadVectors(f) {
		body, _ := base64.StdEncoding.DecodeString(v.BodyB64)
		ct, _ := v.Properties["content_type"].(string)
		comp, _ := v.Headers["compression"].(string)
		hdr, _ := json.Marshal(v.Headers)
		f.Add(body, ct, comp, string(hdr))
	}
	f.Add([]byte(`[[], {}, {}]`), "application/json", "", `{"task": "t", "timelimit": [1, 2]}`)
	f.Add([]byte{0x80, 0x04}, "application/x-python-serialize", "", `{}`)
	sentinels := []error{ErrUnsupportedContentType, ErrPickle, ErrCompression, ErrTooLarge, ErrMalformed, ErrShape, ErrBadHeader}
	dec := NewDecoder(Limits{MaxBodyBytes: 1 << 20})
	f.Fuzz(func(t *testing.T, body []byte, contentType, compression, headersJSON string) {
		var headers map[string]any
		if json.Unmarshal([]byte(headersJSON), &headers) != nil {
			headers = map[string]any{"task": headersJSON}
		}
		if headers == nil { // "null"
			headers = map[string]any{}
		}
		if compression != "" {
			headers["compression"] = compression
		}
		m, err := dec.Decode(&Delivery{ContentType: contentType, Headers: headers, Body: body})
		if err != nil {
			if m != nil || !IsDecodeError(err) || Reason(err) == "" {
				t.Fatalf("bad error %v (message %v)", err, m)
			}
			n := 0
			for _, s := range sentinels {
				if errors.Is(err, s) {
					n++
				}
			}
			if n != 1 {
				t.Fatalf("error %v matches %d sentinels", err, n)
			}
			return
		}
		if m.Task == "" || m.ID == "" {
			t.Fatalf("decoded without task or id: %+v", m)
		}
		if m.Protocol != 1 && m.Protocol != 2 {
			t.Fatalf("protocol %d", m.Protocol)
		}
		if m.Args == nil || m.Kwargs == nil {
			t.Fatalf("nil args or kwargs")
		}
		if _, err := CanonicalArgs(m.Args, m.Kwargs); err != nil {
			t.Fatalf("canonical: %v", err)
		}
	})
}
