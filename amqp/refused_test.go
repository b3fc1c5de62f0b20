package amqp

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	amqp091 "github.com/onceler/onceler/internal/amqp091"

	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// current returns the publisher's shared session.
func (p *Publisher) current() *pubSession {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cur
}

// TestPublishRefusedIsPermanent: each publish the broker (or amqp091-go,
// before sending) refuses for what it is fails at once with a
// *RefusedError, IsPermanent, and costs neither the shared connection nor
// the publishes around it; a publish cut short by its context is not
// permanent.
func TestPublishRefusedIsPermanent(t *testing.T) {
	_, q, p, ctx := declaredQueue(t, "onceler_amqp_refused", 60*time.Second)
	must(t, p.Publish(ctx, "", q, textMessage("before"), PublishOptions{Mandatory: true}), "publish before")
	shared := p.current()
	long := strings.Repeat("x", 300)
	big := strings.Repeat("h", 140_000)
	for _, tc := range []struct {
		name          string
		exchange, key string
		edit          func(m map[string]any) (correlation, replyTo string)
		cause         error
		code          int
	}{
		{name: "missing exchange", exchange: testenv.Name("onceler_amqp_noex"), key: "k", cause: ErrNotFound, code: 404},
		{name: "amq.foo", exchange: "amq.foo", key: "k", cause: ErrNotFound, code: 404},
		{name: "internal exchange", exchange: "amq.rabbitmq.trace", key: "k", code: 403},
		{name: "correlation id over 255 bytes", key: q, edit: func(map[string]any) (string, string) { return long, "" }, cause: ErrTooLong},
		{name: "reply_to over 255 bytes", key: q, edit: func(map[string]any) (string, string) { return "", long }, cause: ErrTooLong},
		{name: "routing key over 255 bytes", key: long, cause: ErrTooLong},
		{name: "header name over 255 bytes", key: q, edit: func(h map[string]any) (string, string) { h[long] = 1; return "", "" }, cause: ErrTooLong},
		{name: "headers larger than a frame", key: q, edit: func(h map[string]any) (string, string) { h["big"] = big; return "", "" }, cause: ErrFrameTooLarge},
		{name: "undecodable direct reply-to", key: "amq.rabbitmq.reply-to.g2dkAA.x", code: 541},
		{name: "undecodable direct reply-to (channel)", key: "amq.rabbitmq.reply-to.a.b", code: 541},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := textMessage("hostile")
			m.Headers = map[string]any{"task": "t"}
			if tc.edit != nil {
				m.CorrelationID, m.ReplyTo = tc.edit(m.Headers)
			}
			// Normal publishes go on around the refused one.
			var wg sync.WaitGroup
			errs := make([]error, 20)
			for i := range errs {
				wg.Add(1)
				go func() {
					defer wg.Done()
					errs[i] = p.Publish(ctx, "", q, textMessage("around"), PublishOptions{Mandatory: true})
				}()
			}
			start := time.Now()
			err := p.Publish(ctx, tc.exchange, tc.key, m, PublishOptions{})
			wg.Wait()
			var re *RefusedError
			if !IsPermanent(err) || !errors.Is(err, ErrRefused) || !errors.As(err, &re) {
				t.Fatalf("publish = %v, want a *RefusedError", err)
			}
			if tc.cause != nil && !errors.Is(err, tc.cause) {
				t.Errorf("publish = %v, want it to wrap %v", err, tc.cause)
			}
			if re.Code != tc.code {
				t.Errorf("code %d, want %d", re.Code, tc.code)
			}
			if n := len(err.Error()); n > 1500 {
				t.Errorf("error text of %d bytes", n)
			}
			if d := time.Since(start); d > 10*time.Second {
				t.Errorf("refused after %s", d)
			}
			for i, err := range errs {
				must(t, err, "publish %d beside the refused one", i)
			}
			if p.current() != shared {
				t.Errorf("the shared publishing connection was replaced")
			}
		})
	}
	if d := testkit.QueueDepth(t, testenv.AMQPURL(t), q); d != 1+10*20 {
		t.Errorf("queue depth %d, want %d", d, 1+10*20)
	}

	// The first publish to a named exchange goes on a side channel: an
	// unroutable mandatory one is returned there as on the shared channel,
	// and a routed one arrives.
	for i := range 2 {
		if err := p.Publish(ctx, q, "nowhere", textMessage("x"), PublishOptions{Mandatory: true}); !errors.Is(err, ErrReturned) {
			t.Errorf("unroutable mandatory publish %d to a named exchange = %v, want ErrReturned", i, err)
		}
	}
	fresh := newPublisher(t, testConfig(t))
	must(t, fresh.Publish(ctx, q, q, textMessage("first"), PublishOptions{Mandatory: true}), "first publish to a named exchange")
	must(t, fresh.Publish(ctx, q, q, textMessage("second"), PublishOptions{Mandatory: true}), "second publish to a named exchange")
	if d := testkit.QueueDepth(t, testenv.AMQPURL(t), q); d != 1+10*20+2 {
		t.Errorf("queue depth %d, want %d", d, 1+10*20+2)
	}

	// A valid direct reply-to address is published (the broker drops it
	// when its consumer is gone).
	must(t, p.Publish(ctx, "", "amq.rabbitmq.reply-to.nobody", textMessage("x"), PublishOptions{}), "direct reply-to without a consumer")

	// Not permanent: a publish cut short by its context.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if err := p.Publish(cctx, "", q, textMessage("late"), PublishOptions{}); err == nil || IsPermanent(err) {
		t.Errorf("publish with a cancelled context = %v, want a non-permanent error", err)
	}
}

// TestDeclareRefusedIsPermanent: a queue name the broker reserves (amq.*)
// or that is too long is refused, permanently, without closing the
// publisher's connection; a wrong password is not a refusal of the declare.
func TestDeclareRefusedIsPermanent(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t)
	p := newPublisher(t, cfg)
	ctx := ctxTimeout(t, 30*time.Second)
	for _, name := range []string{"amq.foo", strings.Repeat("q", 300)} {
		err := p.Declare(ctx, CeleryQueue(name))
		if !IsPermanent(err) {
			t.Errorf("declare %.20q = %v, want permanent", name, err)
		}
	}
	if err := p.Declare(ctx, CeleryQueue("amq.foo")); !errors.Is(err, ErrAccessRefused) {
		t.Errorf("declare amq.foo = %v, want ErrAccessRefused", err)
	}
	bad := cfg
	bad.URL = strings.Replace(cfg.URL, "guest:guest", "guest:wrong", 1)
	if bad.URL == cfg.URL {
		t.Skip("test broker URL has no guest:guest credentials to spoil")
	}
	bp := newPublisher(t, bad)
	if err := bp.Declare(ctx, CeleryQueue(testenv.Name("onceler_amqp_q"))); err == nil || IsPermanent(err) {
		t.Errorf("declare with a wrong password = %v, want a non-permanent error", err)
	}
}

// The sizes measured are those amqp091-go writes.
func TestHeadersSize(t *testing.T) {
	t.Parallel()
	n, err := HeadersSize(map[string]any{"a": "xyz", "b": int64(1), "c": []any{true, nil}, "d": map[string]any{"e": int32(2)}})
	if err != nil {
		t.Fatal(err)
	}
	// table length 4; "a": 1+1 + 'S'+4+3; "b": 1+1 + 9; "c": 1+1 + 'A'+4 + 2 + 1;
	// "d": 1+1 + 'F' + 4 + (1+1 + 5)
	want := 4 + (2 + 8) + (2 + 9) + (2 + 5 + 3) + (2 + 1 + 4 + 7)
	if n != want {
		t.Errorf("size %d, want %d", n, want)
	}
	if _, err := HeadersSize(map[string]any{strings.Repeat("k", 256): 1}); !errors.Is(err, ErrTooLong) {
		t.Errorf("header name of 256 bytes: %v, want ErrTooLong", err)
	}
}

// A message whose header frame is exactly frame_max goes; one byte more is
// refused before sending: the measure is amqp091's and the broker's.
func TestPublishFrameBoundary(t *testing.T) {
	t.Parallel()
	_, q, p, ctx := declaredQueue(t, "onceler_amqp_frame", 30*time.Second)
	must(t, p.Publish(ctx, "", q, textMessage("before"), PublishOptions{}), "publish before")
	shared := p.current()
	frameMax := shared.conn.Config.FrameSize
	msg := func(n int) *amqp091.Publishing {
		m := textMessage("x")
		return &amqp091.Publishing{ContentType: m.ContentType, ContentEncoding: m.ContentEncoding, DeliveryMode: 2,
			Headers: amqp091.Table{"big": strings.Repeat("b", n)}}
	}
	base, err := headerFrameSize(msg(0))
	must(t, err, "size")
	fits := frameMax - base
	send := func(n int) error {
		m := textMessage("x")
		m.Headers = map[string]any{"big": strings.Repeat("b", n)}
		return p.Publish(ctx, "", q, m, PublishOptions{})
	}
	must(t, send(fits), "publish of a header frame of exactly frame_max (%d)", frameMax)
	if err := send(fits + 1); !errors.Is(err, ErrFrameTooLarge) {
		t.Fatalf("publish one byte over frame_max = %v, want ErrFrameTooLarge", err)
	}
	must(t, p.Publish(ctx, "", q, textMessage("after"), PublishOptions{}), "publish after")
	if p.current() != shared {
		t.Fatal("the shared publishing connection was replaced")
	}
	if d := testkit.QueueDepth(t, testenv.AMQPURL(t), q); d != 3 {
		t.Fatalf("queue depth %d, want 3", d)
	}
}
