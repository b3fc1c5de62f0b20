package celeryproto

import (
	"testing"

	"github.com/onceler/onceler/internal/testkit"
)

// typicalDelivery is a protocol 2 JSON task message of about 1 KiB, with the
// headers Celery 5.2 sends and a link, as a worker sees it from amqp091.
func typicalDelivery() *Delivery {
	body := `[[42, "order-2024-000123", 129.95], {"customer_id": 981273, "currency": "EUR", ` +
		`"items": [{"sku": "A-100", "qty": 2, "price": 19.99}, {"sku": "B-220", "qty": 1, "price": 89.97}, ` +
		`{"sku": "C-310", "qty": 3, "price": 4.5}, {"sku": "D-415", "qty": 1, "price": 12.0}, {"sku": "E-520", "qty": 6, "price": 0.99}], ` +
		`"billing": {"name": "Ada Lovelace", "street": "12 Analytical Engine Way", "city": "London", "zip": "N1 9GU", "country": "GB", "vat_id": "GB123456789"}, ` +
		`"tags": ["priority", "gift", "returning-customer"], "placed_at": "2024-05-01T12:00:00.123456+00:00", ` +
		`"shipping": {"name": "Ada Lovelace", "street": "12 Analytical Engine Way", "city": "London", "zip": "N1 9GU", "country": "GB"}, ` +
		`"notify": true, "note": null}, {"callbacks": [{"task": "shop.tasks.send_receipt", "args": [], "kwargs": {"template": "receipt"}, ` +
		`"options": {"queue": "mail"}, "subtask_type": null, "immutable": false}], "errbacks": null, "chain": null, "chord": null}]`
	id := "d5c8a0b4-3c1e-4f9a-9d8e-2b7f6a1c0e11"
	return &Delivery{
		ContentType: "application/json", ContentEncoding: "utf-8",
		CorrelationID: id, ReplyTo: "2a3f1c0e-6b0d-3f7e-9a51-0c8d7e6f5a4b", DeliveryMode: 2,
		Headers: map[string]any{
			"lang": "py", "task": "shop.tasks.charge_order", "id": id, "shadow": nil,
			"eta": nil, "expires": "2031-05-01T12:00:00.123456+00:00", "group": nil, "group_index": nil,
			"retries": int32(0), "timelimit": []any{int32(300), int32(240)}, "root_id": id, "parent_id": nil,
			"argsrepr":   "(42, 'order-2024-000123', 129.95)",
			"kwargsrepr": "{'customer_id': 981273, 'currency': 'EUR', 'items': [...], 'shipping': {...}}",
			"origin":     "gen4242@web-7", "ignore_result": false, "idempotency_key": "charge:order-2024-000123",
		},
		Body: []byte(body),
	}
}

func BenchmarkDecodeJSON(b *testing.B) {
	d := typicalDelivery()
	if _, err := Decode(d); err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(d.Body)))
	b.ReportAllocs()
	start := testkit.CPUTime()
	for b.Loop() {
		if _, err := Decode(d); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(testkit.CPUTime()-start)/float64(b.N), "cpu-ns/op")
}

func BenchmarkEncodeResult(b *testing.B) {
	r := &Result{TaskID: "d5c8a0b4-3c1e-4f9a-9d8e-2b7f6a1c0e11", Status: StateSuccess,
		Value: map[string]any{"charged": 129.95, "currency": "EUR", "payment_id": "pay_7d1e9a", "attempt": int64(1)}}
	b.ReportAllocs()
	start := testkit.CPUTime()
	for b.Loop() {
		if _, err := EncodeResult(r); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(testkit.CPUTime()-start)/float64(b.N), "cpu-ns/op")
}

func BenchmarkEncodeTask(b *testing.B) {
	m, err := Decode(typicalDelivery())
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := EncodeTask(m, EncodeOptions{}); err != nil {
			b.Fatal(err)
		}
	}
}

// TestDecodeTypical pins what the benchmark decodes.
func TestDecodeTypical(t *testing.T) {
	t.Parallel()
	d := typicalDelivery()
	if n := len(d.Body); n < 700 || n > 1300 {
		t.Fatalf("typical body is %d bytes, want about 1 KiB", n)
	}
	m, err := Decode(d)
	if err != nil {
		t.Fatal(err)
	}
	if m.Task != "shop.tasks.charge_order" || m.Args[0] != int64(42) || m.Kwargs["customer_id"] != int64(981273) ||
		m.TimeLimit.Hard.Seconds() != 300 || m.Headers["idempotency_key"] != "charge:order-2024-000123" || len(m.Callbacks) != 1 {
		t.Fatalf("decoded %+v", m)
	}
}

// TestDecodeAllocs keeps the decoder's allocation budget: a typical 1 KiB
// protocol 2 JSON message must decode in fewer than 50 allocations.
func TestDecodeAllocs(t *testing.T) {
	if testing.Short() {
		t.Skip("allocation count")
	}
	d := typicalDelivery()
	n := testing.AllocsPerRun(200, func() {
		if _, err := Decode(d); err != nil {
			t.Fatal(err)
		}
	})
	if n >= 50 {
		t.Fatalf("decode of a typical message: %.0f allocations, want < 50", n)
	}
}

// BenchmarkDecodeSmall decodes a Celery message with one argument and no
// options, as send_task(name, args=[op]) sends it.
func BenchmarkDecodeSmall(b *testing.B) {
	d := typicalDelivery()
	d.Body = []byte(`[["op-000123"], {}, {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]`)
	if _, err := Decode(d); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Decode(d); err != nil {
			b.Fatal(err)
		}
	}
}
