package amqp

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// Everything handed to Publish arrives as sent, headers included.
func TestPublishConfirmedRoundTrip(t *testing.T) {
	t.Parallel()
	_, q, p, ctx := declaredQueue(t, "onceler_amqp_pub", 20*time.Second)
	when := time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)
	msg := &celeryproto.Publishing{
		ContentType: "application/json", ContentEncoding: "utf-8",
		Body:          []byte(`[[2, 3], {}, {}]`),
		CorrelationID: "id-1", ReplyTo: "reply-q", DeliveryMode: 2, Priority: 3, Expiration: "60000",
		Headers: map[string]any{
			"task": "t.add", "retries": 2, "eta": nil, "ignore_result": false,
			"timelimit": []any{int64(30), nil},
			"stamps":    map[string]any{"a": []string{"x", "y"}, "n": uint64(5)},
			"when":      when, "raw": []byte{0, 1},
		},
	}
	headersBefore := fmt.Sprint(msg.Headers)
	must(t, p.Publish(ctx, "", q, msg, PublishOptions{Mandatory: true}), "publish")
	if fmt.Sprint(msg.Headers) != headersBefore {
		t.Fatal("Publish changed the caller's headers")
	}
	var got *Delivery
	n, err := p.Inspect(ctx, q, 1, func(d *Delivery) (InspectAction, error) {
		got = d
		return Remove, nil
	})
	must(t, err, "inspect")
	if n != 1 || got == nil {
		t.Fatalf("inspect saw %d messages", n)
	}
	if got.CorrelationID != "id-1" || got.ReplyTo != "reply-q" || got.DeliveryMode != 2 || got.Priority != 3 ||
		got.Expiration != "60000" || got.ContentType != "application/json" || got.ContentEncoding != "utf-8" ||
		string(got.Body) != `[[2, 3], {}, {}]` {
		t.Fatalf("properties differ: %+v", got.Delivery)
	}
	h := got.Headers
	stamps, ok := h["stamps"].(map[string]any)
	if !ok {
		t.Fatalf("nested table arrived as %T, want map[string]any", h["stamps"])
	}
	tl, _ := h["timelimit"].([]any)
	if h["task"] != "t.add" || intOf(h["retries"]) != 2 || h["eta"] != nil || h["ignore_result"] != false ||
		len(tl) != 2 || tl[0] != int64(30) || tl[1] != nil ||
		fmt.Sprint(stamps["a"]) != "[x y]" || intOf(stamps["n"]) != 5 ||
		!h["when"].(time.Time).Equal(when) || string(h["raw"].([]byte)) != "\x00\x01" {
		t.Fatalf("headers differ: %#v", h)
	}
	if d := testkit.QueueDepth(t, testenv.AMQPURL(t), q); d != 0 {
		t.Fatalf("queue depth %d after Remove, want 0", d)
	}
}

func TestPublishMandatoryUnroutableReturned(t *testing.T) {
	t.Parallel()
	_, q, p, ctx := declaredQueue(t, "onceler_amqp_mand", 20*time.Second)
	missing := testenv.Name("onceler_amqp_nosuchqueue")

	// Routed and unroutable publishes interleaved from many goroutines: each
	// caller gets its own outcome.
	var wg sync.WaitGroup
	errs := make([]error, 200)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			key := q
			if i%2 == 1 {
				key = missing
			}
			errs[i] = p.Publish(ctx, "", key, textMessage(fmt.Sprint(i)), PublishOptions{Mandatory: true})
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if i%2 == 0 {
			must(t, err, "routed publish %d", i)
			continue
		}
		var re *ReturnedError
		if !errors.Is(err, ErrReturned) || !errors.As(err, &re) || re.RoutingKey != missing || re.Code != 312 {
			t.Fatalf("unroutable publish %d: %v, want *ReturnedError 312 NO_ROUTE", i, err)
		}
	}
	if d := testkit.QueueDepth(t, testenv.AMQPURL(t), q); d != 100 {
		t.Fatalf("queue depth %d, want 100 routed messages", d)
	}
	// Without mandatory the broker drops it and confirms: no error.
	must(t, p.Publish(ctx, "", missing, textMessage("x"), PublishOptions{}), "non-mandatory unroutable")
}

// A queue that rejects publishes when full answers with a negative confirm.
func TestPublishNacked(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t)
	q := testenv.Name("onceler_amqp_nack")
	cleanupQueue(t, q)
	p := newPublisher(t, cfg)
	ctx := ctxTimeout(t, 20*time.Second)
	spec := QueueSpec{Name: q, Exchange: DefaultExchange, Args: map[string]any{"x-max-length": 1, "x-overflow": "reject-publish"}}
	must(t, p.Declare(ctx, spec), "declare")
	must(t, p.Publish(ctx, "", q, textMessage("1"), PublishOptions{}), "first publish")
	if err := p.Publish(ctx, "", q, textMessage("2"), PublishOptions{}); !errors.Is(err, ErrNacked) {
		t.Fatalf("publish to a full reject-publish queue = %v, want ErrNacked", err)
	}
	// The channel is still usable.
	_, err := p.DeleteQueue(ctx, q)
	must(t, err, "delete")
}

// Publishing to a missing exchange fails alone; the shared channel and the
// other publishes are unharmed.
func TestPublishMissingExchange(t *testing.T) {
	_, q, p, ctx := declaredQueue(t, "onceler_amqp_noex", 20*time.Second)
	must(t, p.Publish(ctx, "", q, textMessage("1"), PublishOptions{}), "publish before")
	err := p.Publish(ctx, testenv.Name("onceler_amqp_noexchange"), "k", textMessage("x"), PublishOptions{})
	if !errors.Is(err, ErrNotFound) {
		t.Fatalf("publish to a missing exchange = %v, want ErrNotFound", err)
	}
	must(t, p.Publish(ctx, q, q, textMessage("2"), PublishOptions{Mandatory: true}), "publish after")
	if d := testkit.QueueDepth(t, testenv.AMQPURL(t), q); d != 2 {
		t.Fatalf("queue depth %d, want 2", d)
	}
}

// The broker closes the publisher's connection; the next Publish reconnects.
func TestPublisherReconnects(t *testing.T) {
	cfg, q, p, ctx := declaredQueue(t, "onceler_amqp_pubrecon", 30*time.Second)
	must(t, p.Publish(ctx, "", q, textMessage("1"), PublishOptions{}), "publish before")
	if n := closeConnection(t, cfg.Name+" publish"); n != 1 {
		t.Fatalf("closed %d publisher connections, want 1", n)
	}
	testkit.WaitFor(t, "publisher notices the close", 10*time.Second, func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.cur == nil || p.cur.isDead()
	})
	must(t, p.Publish(ctx, "", q, textMessage("2"), PublishOptions{Mandatory: true}), "publish after")
	if d := testkit.QueueDepth(t, testenv.AMQPURL(t), q); d != 2 {
		t.Fatalf("queue depth %d, want 2", d)
	}
	must(t, p.Close(), "close")
	if err := p.Publish(ctx, "", q, textMessage("3"), PublishOptions{}); !errors.Is(err, ErrClosed) {
		t.Fatalf("publish after Close = %v, want ErrClosed", err)
	}
}

func TestInspectKeepRemoveStop(t *testing.T) {
	t.Parallel()
	_, q, p, ctx := declaredQueue(t, "onceler_amqp_inspect", 20*time.Second)
	for i := range 4 {
		must(t, p.Publish(ctx, "", q, textMessage(fmt.Sprint(i)), PublishOptions{}), "publish")
	}
	var bodies []string
	n, err := p.Inspect(ctx, q, 0, func(d *Delivery) (InspectAction, error) {
		bodies = append(bodies, string(d.Body))
		if string(d.Body) == "1" {
			return Remove, nil
		}
		return Keep, nil
	})
	must(t, err, "inspect")
	if n != 4 || fmt.Sprint(bodies) != "[0 1 2 3]" {
		t.Fatalf("inspect saw %d: %v", n, bodies)
	}
	testkit.WaitFor(t, "3 messages left", 5*time.Second, func() bool { return testkit.QueueDepth(t, testenv.AMQPURL(t), q) == 3 })
	bodies = nil
	stopErr := errors.New("stop here")
	n, err = p.Inspect(ctx, q, 0, func(d *Delivery) (InspectAction, error) {
		bodies = append(bodies, string(d.Body))
		if len(bodies) == 2 {
			return Keep, stopErr
		}
		return Keep, nil
	})
	if !errors.Is(err, stopErr) || n != 2 || fmt.Sprint(bodies) != "[0 2]" {
		t.Fatalf("inspect with error: n=%d err=%v bodies=%v", n, err, bodies)
	}
	n, err = p.Inspect(ctx, q, 0, func(d *Delivery) (InspectAction, error) { return Stop, nil })
	must(t, err, "inspect stop")
	if n != 1 {
		t.Fatalf("Stop after %d messages, want 1", n)
	}
	testkit.WaitFor(t, "3 messages kept", 5*time.Second, func() bool { return testkit.QueueDepth(t, testenv.AMQPURL(t), q) == 3 })
	// A walk of all sees what the queue held when it began: a message put
	// back meanwhile (a worker quarantining a requeued message again) waits
	// for the next walk, rather than keeping this one going.
	n, err = p.Inspect(ctx, q, 0, func(d *Delivery) (InspectAction, error) {
		if err := p.Publish(ctx, "", q, textMessage(string(d.Body)), PublishOptions{}); err != nil {
			return Keep, err
		}
		return Remove, nil
	})
	must(t, err, "inspect and put back")
	if n != 3 {
		t.Fatalf("walk while putting back saw %d messages, want the 3 queued", n)
	}
	testkit.WaitFor(t, "3 messages put back", 5*time.Second, func() bool { return testkit.QueueDepth(t, testenv.AMQPURL(t), q) == 3 })
	if _, err := p.Inspect(ctx, testenv.Name("onceler_amqp_missing"), 0, nil); !errors.Is(err, ErrNotFound) {
		t.Fatalf("inspect of a missing queue = %v, want ErrNotFound", err)
	}
}

// Publish honours its context while the broker cannot be reached, and the
// password never shows in errors or logs.
func TestPublishUnreachableBrokerHonoursContext(t *testing.T) {
	cfg := testConfig(t)
	cfg.URL = "amqp://guest:s3cr3t-pw@127.0.0.1:1//"
	p := newPublisher(t, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	err := p.Publish(ctx, "", "q", textMessage("x"), PublishOptions{})
	if err == nil || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("publish to an unreachable broker = %v, want a deadline error", err)
	}
	if time.Since(start) > 3*time.Second {
		t.Fatalf("publish took %v despite a 300ms context", time.Since(start))
	}
	assertNoSecret(t, err.Error(), "s3cr3t-pw")
}

// While the broker blocks the connection (resource alarm), publishes wait,
// bounded by their context, and go on once it unblocks.
func TestPublishWaitsWhileBlocked(t *testing.T) {
	s := &pubSession{dead: make(chan struct{})}
	s.setBlocked(true)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := s.waitUnblocked(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("blocked wait = %v, want the context's deadline", err)
	}
	go func() {
		time.Sleep(30 * time.Millisecond)
		s.setBlocked(false)
	}()
	must(t, s.waitUnblocked(ctxTimeout(t, 5*time.Second)), "wait until unblocked")
	s.setBlocked(true)
	close(s.dead)
	if err := s.waitUnblocked(ctxTimeout(t, 5*time.Second)); !errors.Is(err, errNotSent) {
		t.Fatalf("blocked then dead = %v, want errNotSent (retried on a new connection)", err)
	}
}

// Publishing from many goroutines while the broker closes the connection:
// every confirmed message is in the queue, and every failure says the
// outcome is unknown (never a silent loss, never a false ErrNacked).
func TestPublishDuringConnectionLoss(t *testing.T) {
	cfg, q, p, ctx := declaredQueue(t, "onceler_amqp_publoss", 60*time.Second)
	var (
		mu        sync.Mutex
		confirmed int
		unknown   int
		other     []error
	)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				err := p.Publish(ctx, "", q, textMessage(fmt.Sprintf("%d-%d", g, i)), PublishOptions{Mandatory: i%2 == 0})
				mu.Lock()
				switch {
				case err == nil:
					confirmed++
				case errors.Is(err, ErrUnconfirmed):
					unknown++
				default:
					other = append(other, err)
				}
				mu.Unlock()
			}
		}()
	}
	time.Sleep(200 * time.Millisecond)
	if n := closeConnection(t, cfg.Name+" publish"); n != 1 {
		t.Errorf("closed %d publisher connections, want 1", n)
	}
	time.Sleep(300 * time.Millisecond)
	close(stop)
	wg.Wait()
	if len(other) > 0 {
		t.Fatalf("%d publishes failed otherwise, first: %v", len(other), other[0])
	}
	depth := testkit.QueueDepth(t, testenv.AMQPURL(t), q)
	t.Logf("confirmed %d, unknown %d, in queue %d", confirmed, unknown, depth)
	if depth < confirmed || depth > confirmed+unknown {
		t.Fatalf("queue holds %d messages; confirmed %d, unknown %d", depth, confirmed, unknown)
	}
	if p.gen.Load() < 2 {
		t.Fatal("publisher never reconnected")
	}
}

// Close while publishes are in flight: each ends with success, ErrClosed or
// ErrUnconfirmed, and Close waits for the publisher's goroutines.
func TestPublisherCloseDuringPublishes(t *testing.T) {
	cfg := testConfig(t)
	q := testenv.Name("onceler_amqp_close")
	cleanupQueue(t, q)
	p := NewPublisher(cfg)
	ctx := ctxTimeout(t, 30*time.Second)
	must(t, p.Declare(ctx, CeleryQueue(q)), "declare")
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				err := p.Publish(ctx, "", q, textMessage("x"), PublishOptions{Mandatory: true})
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	time.Sleep(100 * time.Millisecond)
	must(t, p.Close(), "close")
	wg.Wait()
	close(errs)
	for err := range errs {
		if !errors.Is(err, ErrClosed) && !errors.Is(err, ErrUnconfirmed) {
			t.Fatalf("publish during Close = %v, want ErrClosed or ErrUnconfirmed", err)
		}
	}
}

// TestExchangeDeclaredMomentLaterNotPermanent: an exchange that is
// missing for a moment (a non-durable exchange after a broker restart,
// until its owner declares it again; an application that declares its
// exchange when it starts, after the worker) is a state of the broker, not
// a refusal of what the publish asks: the publish is looked at again, and
// succeeds once the exchange is there 300 ms later.
func TestExchangeDeclaredMomentLaterNotPermanent(t *testing.T) {
	_, q, p, ctx := declaredQueue(t, "onceler_amqp_lateex", 20*time.Second)
	ex := testenv.Name("onceler_amqp_lateex_x")
	conn, err := amqp091.Dial(testenv.AMQPURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ch.ExchangeDelete(ex, false, false) })
	declared := make(chan error, 1)
	go func() {
		time.Sleep(300 * time.Millisecond)
		if err := ch.ExchangeDeclare(ex, "direct", false, false, false, false, nil); err != nil {
			declared <- err
			return
		}
		declared <- ch.QueueBind(q, "k", ex, false, nil)
	}()
	start := time.Now()
	err = p.Publish(ctx, ex, "k", textMessage("x"), PublishOptions{Mandatory: true})
	took := time.Since(start)
	if derr := <-declared; derr != nil {
		t.Fatal(derr)
	}
	if IsPermanent(err) {
		t.Fatalf("publish to an exchange declared 300 ms later: permanent after %s: %v", took.Round(time.Millisecond), err)
	}
	if err != nil {
		t.Logf("publish failed (not permanent): %v", err)
	}
}
