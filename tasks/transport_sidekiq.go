package tasks

// The Sidekiq transport (transport.go): Sidekiq jobs from Redis, through a
// client with a reliable fetch (sidekiqClient: package sidekiq's Client
// satisfies it with J = *sidekiq.Job). A fetched job sits in the process's
// working list until the client settles it: Done when answered (ack),
// Requeue (giveBack), Schedule (republish), Retry (retry: Sidekiq's retry
// set and backoff, its dead set once retries are used up) or Kill
// (quarantine: the dead set); a failed run goes to Retry too (failed:
// failingDelivery). Each move settles the job at once, so the ack
// that follows it sends nothing. A delivery is held by leaving it in the
// working list; it is stale once the client says the job is no longer its
// own (another process recovered it, taking this one for dead). The worker
// reads the job in Celery's wire form: task name its class, task id its jid,
// its args, retries its retry_count + 1, and its idempotency_key header.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/clip"
	"github.com/onceler/onceler/internal/pause"
	"github.com/onceler/onceler/sidekiq"
)

// sidekiqClient is what the Sidekiq transport needs of a client whose jobs
// are of type J. Fetch moves a job into the process's working list; on a
// job that cannot be decoded it returns the job (enough of it to Kill) and
// the error. Done, Requeue, Schedule, Retry and Kill take the job out of
// the working list, each atomically with its move.
type sidekiqClient[J comparable] interface {
	Fetch(ctx context.Context) (J, error)
	Done(ctx context.Context, j J) error
	Requeue(ctx context.Context, j J) error
	Schedule(ctx context.Context, j J, at time.Time) error
	Retry(ctx context.Context, j J, errClass, errMsg string, backtrace []string) (sidekiq.RetryOutcome, error)
	Kill(ctx context.Context, j J, errClass, errMsg string) error
	// Held reports, for each job, whether the process still holds it
	// (another process did not recover it), in one Redis read.
	Held(ctx context.Context, jobs []J) ([]bool, error)
	Close() error
}

// sidekiqHeldCheck is how often the transport asks whether it still holds
// the jobs it fetched and has not settled: a job another process recovered
// (taking this one for dead) makes its delivery stale within about this
// long, so that the pipeline does not run it here too.
const sidekiqHeldCheck = 250 * time.Millisecond

// sidekiqJob is what the transport reads of a job (sidekiqTransport.view).
type sidekiqJob struct {
	Queue, Class, JID, IdempotencyKey string
	// Raw is the job as fetched (what a held record keeps).
	Raw string
	// Args are the positional arguments, numbers as json.Number.
	Args []any
	// RetryCount is the job's retry_count: -1 when it never failed.
	RetryCount int
	// Recovered: the job came back from the working list of a process
	// taken for dead, and a run of it may have begun.
	Recovered bool
}

// sidekiqTransport consumes through client, at most the prefetch window's
// jobs unsettled at once.
type sidekiqTransport[J comparable] struct {
	client sidekiqClient[J]
	view   func(J) sidekiqJob
	// notHeld is the client's error (wrapped) for a job no longer in its
	// working list (sidekiq.ErrNotHeld).
	notHeld error

	// begin and end, when set, show each run of a job (the client's Begin
	// and End).
	begin func(J)
	end   func(J, bool)
	// count, when set, counts a fetch of the job and returns how many its
	// counter holds (1: the first); forget removes the counter once the job
	// is settled for good (not when it is handed back); uncount takes the
	// fetch of each job off its counter: the job is handed back without
	// a run of it begun (giveBack, uncountUnstarted), so that only
	// deliveries whose run may have begun reach the poison limit.
	count   func(context.Context, J) (int, error)
	forget  func(context.Context, J) error
	uncount func(context.Context, ...J) error

	// log, when set, tells of give-backs that fail.
	log *zap.Logger

	mu       sync.Mutex
	out      int // jobs fetched and not settled
	prefetch int
	limit    int // the window's cap for the memory budget (0: none)
	kick     chan struct{}
	failing  atomic.Bool // the last fetch failed
	failed   func()      // counts a failed fetch (the worker's metric); nil: none
	// held are the deliveries whose job may still be in the working
	// list (not settled, not stale), checked every sidekiqHeldCheck.
	held map[*sidekiqDelivery[J]]struct{}
	// backs are the give-backs under way (giveBack); stopping ends
	// their retries (stopBacks).
	backs    sync.WaitGroup
	stopping bool
	stopCtx  context.Context
	stop     context.CancelFunc
}

func newSidekiqTransport[J comparable](client sidekiqClient[J], view func(J) sidekiqJob, notHeld error, prefetch int) *sidekiqTransport[J] {
	ctx, cancel := context.WithCancel(context.Background())
	return &sidekiqTransport[J]{client: client, view: view, notHeld: notHeld, prefetch: prefetch, kick: make(chan struct{}, 1),
		held: map[*sidekiqDelivery[J]]struct{}{}, stopCtx: ctx, stop: cancel, log: zap.NewNop()}
}

func (t *sidekiqTransport[J]) prepare(context.Context) error { return nil }

// consume fetches while the window has room, until ctx is done. A fetch
// that fails (Redis away) is tried again, at growing intervals up to 5 s.
func (t *sidekiqTransport[J]) consume(ctx context.Context, receive func(delivery)) error {
	checkDone := make(chan struct{})
	go func() {
		defer close(checkDone)
		t.checkHeld(ctx)
	}()
	defer func() { <-checkDone }()
	var zero J
	for failures := 0; ; {
		if !t.reserve(ctx) {
			return nil
		}
		j, err := t.client.Fetch(ctx)
		if j == zero {
			t.unreserve()
			if ctx.Err() != nil {
				return nil
			}
			t.failing.Store(true)
			if t.failed != nil {
				t.failed()
			}
			t.log.Warn("Sidekiq fetch failed; retrying", zap.Error(err))
			if !pause.For(ctx, min(100*time.Millisecond<<min(failures, 6), 5*time.Second)) {
				return nil
			}
			failures++
			continue
		}
		failures = 0
		t.failing.Store(false)
		d := t.newDelivery(j, err)
		t.mu.Lock()
		t.held[d] = struct{}{}
		t.mu.Unlock()
		if t.count != nil && err == nil {
			n, cerr := t.count(ctx, j)
			if cerr != nil {
				n = 0 // unknown: it may have been delivered before
			}
			d.fetches = n
			d.counted.Store(cerr == nil)
		}
		receive(d)
	}
}

// checkHeld asks the client every sidekiqHeldCheck, until ctx is done,
// whether it still holds the jobs of the deliveries not settled; those it
// does not are stale from then on (drop).
func (t *sidekiqTransport[J]) checkHeld(ctx context.Context) {
	tick := time.NewTicker(sidekiqHeldCheck)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		t.mu.Lock()
		ds := make([]*sidekiqDelivery[J], 0, len(t.held))
		jobs := make([]J, 0, len(t.held))
		for d := range t.held {
			ds = append(ds, d)
			jobs = append(jobs, d.job)
		}
		t.mu.Unlock()
		if len(ds) == 0 {
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, max(sidekiqHeldCheck, time.Second))
		held, err := t.client.Held(cctx, jobs)
		cancel()
		if err != nil {
			continue // unknown: a settle tells (ErrNotHeld)
		}
		for i, d := range ds {
			if !held[i] {
				d.drop()
			}
		}
	}
}

// reserve waits for room in the window and takes a place in it.
func (t *sidekiqTransport[J]) reserve(ctx context.Context) bool {
	for {
		t.mu.Lock()
		n := t.prefetch
		if t.limit > 0 {
			n = min(n, t.limit)
		}
		ok := t.out < max(n, 1)
		if ok {
			t.out++
		}
		t.mu.Unlock()
		if ok {
			return true
		}
		select {
		case <-ctx.Done():
			return false
		case <-t.kick:
		}
	}
}

// unreserve gives a place in the window back.
func (t *sidekiqTransport[J]) unreserve() {
	t.mu.Lock()
	t.out--
	t.mu.Unlock()
	t.wake()
}

func (t *sidekiqTransport[J]) wake() {
	select {
	case t.kick <- struct{}{}:
	default:
	}
}

func (t *sidekiqTransport[J]) ready() bool { return !t.failing.Load() }

func (t *sidekiqTransport[J]) setPrefetch(n int) error {
	t.mu.Lock()
	t.prefetch = n
	t.mu.Unlock()
	t.wake()
	return nil
}

func (t *sidekiqTransport[J]) setWindowLimit(n int) error {
	t.mu.Lock()
	t.limit = n
	t.mu.Unlock()
	t.wake()
	return nil
}

func (t *sidekiqTransport[J]) fixedWindow() bool { return false }

func (t *sidekiqTransport[J]) close() error {
	t.stopBacks()
	return t.client.Close()
}

// stopBacks ends the retries of the give-backs under way and waits for
// them: a job whose give-back did not succeed stays in the working list,
// which the caller hands back (RequeueAll) or another process recovers.
// A give-back after it is left to them too.
func (t *sidekiqTransport[J]) stopBacks() {
	t.mu.Lock()
	t.stopping = true
	t.mu.Unlock()
	t.stop()
	t.backs.Wait()
}

// newDelivery is the delivery of a fetched job; decodeErr is why the
// client could not decode it (nil: it could).
func (t *sidekiqTransport[J]) newDelivery(j J, decodeErr error) *sidekiqDelivery[J] {
	v := t.view(j)
	return &sidekiqDelivery[J]{t: t, job: j, v: v, w: sidekiqWire(v, decodeErr), decodeErr: decodeErr, fetches: 1}
}

// sidekiqWire is a job in Celery's wire form: a protocol 2 JSON message. A
// job that cannot be read (decodeErr) or written in that form has its
// HeadersError set, so that the decode stage refuses it and it goes to the
// dead set.
func sidekiqWire(v sidekiqJob, decodeErr error) *celeryproto.Delivery {
	err := decodeErr
	if err == nil {
		m := &celeryproto.Message{Task: v.Class, ID: v.JID, Args: rawNumbers(v.Args).([]any), Retries: max(v.RetryCount+1, 0)}
		if v.IdempotencyKey != "" {
			m.Headers = map[string]any{"idempotency_key": v.IdempotencyKey}
		}
		var p *celeryproto.Publishing
		if p, err = celeryproto.EncodeTask(m, celeryproto.EncodeOptions{Protocol: 2}); err == nil {
			return &celeryproto.Delivery{ContentType: p.ContentType, ContentEncoding: p.ContentEncoding, Headers: p.Headers,
				Body: p.Body, CorrelationID: p.CorrelationID, DeliveryMode: 2, Redelivered: v.Recovered}
		}
	}
	return &celeryproto.Delivery{ContentType: "application/json", ContentEncoding: "utf-8",
		HeadersError: fmt.Errorf("sidekiq job: %w", err), Redelivered: v.Recovered}
}

// rawNumbers is v with each json.Number turned into the JSON it came as,
// which the encoder writes unchanged (it would write a json.Number as a
// string).
func rawNumbers(v any) any {
	switch x := v.(type) {
	case json.Number:
		return json.RawMessage(x)
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			out[i] = rawNumbers(e)
		}
		return out
	case map[string]any:
		out := make(map[string]any, len(x))
		for k, e := range x {
			out[k] = rawNumbers(e)
		}
		return out
	}
	return v
}

// sidekiqDelivery is a delivery of the Sidekiq transport.
type sidekiqDelivery[J comparable] struct {
	t   *sidekiqTransport[J]
	job J
	v   sidekiqJob
	w   *celeryproto.Delivery
	// decodeErr is why the client could not decode the job (nil: it
	// could).
	decodeErr error
	// fetches is how many fetches of the job its counter holds, this one
	// included (sidekiqTransport.count); 0 when unknown.
	fetches int
	// counted: this fetch is on the job's counter; began: a run of the
	// job began (runStarted); uncounted: the fetch was taken off the
	// counter again (uncountable), as its job was handed back unrun.
	counted, began, uncounted atomic.Bool
	// settled: a settle call took the job out of the working list;
	// gone: it is no longer this process's (stale): another process
	// recovered it; freed: its place in the window was given back.
	settled, gone, freed atomic.Bool
	// outcome is where Retry sent the job (sidekiq.RetryOutcome).
	outcome atomic.Int32
}

func (d *sidekiqDelivery[J]) wire() *celeryproto.Delivery { return d.w }
func (d *sidekiqDelivery[J]) origin() origin              { return origin{Queue: d.v.Queue} }
func (d *sidekiqDelivery[J]) redelivered() bool           { return d.v.Recovered || d.fetches != 1 }
func (d *sidekiqDelivery[J]) deliveryCount() int          { return max(d.fetches-1, 0) }
func (d *sidekiqDelivery[J]) deliveryLimit() int          { return 0 }

// passOn is never asked of a Sidekiq delivery (its deliveryLimit is 0).
func (d *sidekiqDelivery[J]) passOn(context.Context, int) error {
	return errors.New("tasks: a Sidekiq job has no delivery limit to pass on")
}
func (d *sidekiqDelivery[J]) stale() bool { return d.gone.Load() }

// settle runs op, a client call that takes the job out of the working
// list, unless a move (republish, retry, quarantine) took it out already:
// the ack that follows a move sends nothing. A stale delivery's job is
// another process's: op is not called (it would find the job not held).
// The job's place in the window is given back once it is out, or when
// last is set (ack: the worker is done with it; a job left in the working
// list by a failed call comes back when this process is taken for dead).
// forGood: op settles the job for good (all but giveBack), so its delivery
// counter goes.
func (d *sidekiqDelivery[J]) settle(op func() error, last, forGood bool) error {
	if d.settled.Load() {
		return nil
	}
	var err error
	if d.gone.Load() {
		err = fmt.Errorf("sidekiq job %s: recovered by another process: %w", d.v.JID, d.t.notHeld)
	} else {
		err = op()
	}
	if err != nil && errors.Is(err, d.t.notHeld) {
		d.drop()
	}
	if err == nil {
		d.settled.Store(true)
		d.untrack()
		if forGood && d.t.forget != nil {
			fctx, cancel := context.WithTimeout(context.Background(), opTimeout)
			_ = d.t.forget(fctx, d.job) // a counter left behind expires
			cancel()
		}
	}
	if err == nil || last {
		d.untrack()
		d.free()
	}
	return err
}

// drop makes the delivery stale: its job is no longer this process's. Its
// place in the window is given back (once).
func (d *sidekiqDelivery[J]) drop() {
	d.gone.Store(true)
	d.untrack()
	d.free()
}

// free gives the delivery's place in the window back, once.
func (d *sidekiqDelivery[J]) free() {
	if !d.freed.Swap(true) {
		d.t.unreserve()
	}
}

// untrack stops the checks of whether the job is still held.
func (d *sidekiqDelivery[J]) untrack() {
	d.t.mu.Lock()
	delete(d.t.held, d)
	d.t.mu.Unlock()
}

func (d *sidekiqDelivery[J]) ack() error {
	return d.settle(func() error {
		ctx, cancel := final(context.Background())
		defer cancel()
		return d.t.client.Done(ctx, d.job)
	}, true, true)
}

// giveBack hands the job back to its queue, asynchronously: the caller
// may hold the worker's lock, and a Redis call may take up to opTimeout. A
// give-back that fails is tried again, at growing intervals up to 5 s,
// until it succeeds, the job is found stale, or the transport closes (the
// job then stays in the working list: close hands it back, or another
// process recovers it). The job's place in the window is given back once
// the give-back is over. It returns nil: what happens is logged.
func (d *sidekiqDelivery[J]) giveBack() error {
	t := d.t
	t.mu.Lock()
	if t.stopping {
		t.mu.Unlock()
		d.free() // left in the working list for close or another process
		return nil
	}
	t.backs.Add(1)
	t.mu.Unlock()
	go func() {
		defer t.backs.Done()
		defer d.free()
		// The fetch comes off the counter before the job is back in its
		// queue: once there, a fetch (this process's or another's) may
		// count it again at once, and would see one delivery too many.
		// If the give-back then fails for good, the job stays unrun in
		// the working list, so the fetch was no run either way.
		d.uncountUnstarted()
		for attempt := 0; ; attempt++ {
			err := d.settle(func() error {
				ctx, cancel := context.WithTimeout(t.stopCtx, opTimeout)
				defer cancel()
				return t.client.Requeue(ctx, d.job)
			}, false, false)
			switch {
			case err == nil:
				return
			case d.stale():
				t.log.Debug("Sidekiq job to hand back was recovered by another process; it runs again", zap.String("jid", d.v.JID))
				return
			case t.stopCtx.Err() != nil:
				t.log.Warn("handing a Sidekiq job back failed while stopping; it stays in this process's working list until it is requeued at exit or recovered",
					zap.String("jid", d.v.JID), zap.String("queue", d.v.Queue), zap.Error(err))
				return
			}
			t.log.Warn("handing a Sidekiq job back failed; retrying (it stays in this process's working list meanwhile)",
				zap.String("jid", d.v.JID), zap.String("queue", d.v.Queue), zap.Int("attempt", attempt+1), zap.Error(err))
			if !pause.For(t.stopCtx, min(100*time.Millisecond<<min(attempt, 6), 5*time.Second)) {
				return
			}
		}
	}()
	return nil
}

// uncountable reports whether the delivery's fetch is to be taken off
// the job's counter, its job handed back: it was counted, no run of it
// began, and it was not taken off already. It is true once at most.
func (d *sidekiqDelivery[J]) uncountable() bool {
	return d.t.uncount != nil && d.counted.Load() && !d.began.Load() && !d.uncounted.Swap(true)
}

// uncountUnstarted takes the fetch of a job to be handed back (Requeue)
// off its counter, unless a run of it began: a graceful hand-back is no
// delivery the poison limit counts.
func (d *sidekiqDelivery[J]) uncountUnstarted() {
	if !d.uncountable() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	if err := d.t.uncount(ctx, d.job); err != nil {
		d.t.log.Warn("taking a Sidekiq job handed back unrun off its delivery count failed; the count stays one too high",
			zap.String("jid", d.v.JID), zap.Error(err))
	}
}

// uncountUnstarted takes off their counters the fetches of the jobs the
// transport still holds whose runs did not begin, before they are handed
// back at close (RequeueAll): each was fetched and counted, and is handed
// back unrun. A job whose run began (abandoned at the end of the grace
// period) keeps its count: its run may have crashed things. Call it once
// the give-backs are over (stopBacks) and no run begins any more.
func (t *sidekiqTransport[J]) uncountUnstarted(ctx context.Context) error {
	if t.uncount == nil {
		return nil
	}
	t.mu.Lock()
	var jobs []J
	for d := range t.held {
		if d.uncountable() {
			jobs = append(jobs, d.job)
		}
	}
	t.mu.Unlock()
	if len(jobs) == 0 {
		return nil
	}
	return t.uncount(ctx, jobs...)
}

// republish moves the job to the schedule set, due at eta (now when it has
// none or it passed).
func (d *sidekiqDelivery[J]) republish(ctx context.Context, eta time.Time) error {
	return d.settle(func() error {
		if now := time.Now(); eta.Before(now) {
			eta = now
		}
		return d.t.client.Schedule(ctx, d.job, eta)
	}, false, true)
}

// retry hands the job to Sidekiq's retry (its own backoff: next's ETA is
// not used), with the retry's cause as the job's error.
func (d *sidekiqDelivery[J]) retry(ctx context.Context, _ *celeryproto.Message, rr *RetryRequest) error {
	class, msg := "Retry", rr.Error()
	if rr.Cause != nil {
		exc := exceptionFor(rr.Cause)
		class, msg = exc.Type, exc.Message
	}
	return d.settle(func() error {
		out, err := d.t.client.Retry(ctx, d.job, class, msg, nil)
		d.outcome.Store(int32(out))
		return err
	}, false, true)
}

// retryOutcome is where the last retry or failed call sent the job (0:
// none succeeded).
func (d *sidekiqDelivery[J]) retryOutcome() sidekiq.RetryOutcome {
	return sidekiq.RetryOutcome(d.outcome.Load())
}

// quarantine moves the job to the dead set, its error class the reason
// (sidekiqErrorClass) and its message the detail.
func (d *sidekiqDelivery[J]) quarantine(ctx context.Context, ours map[string]any) error {
	reason, _ := ours[HeaderReason].(string)
	detail, _ := ours[HeaderDetail].(string)
	if d.decodeErr != nil {
		// The client's own words, not the Celery decoder's about the
		// wire form it was given.
		detail = d.decodeErr.Error()
	}
	return d.settle(func() error {
		return d.t.client.Kill(ctx, d.job, sidekiqErrorClass(reason), clip.String(detail, maxDetail))
	}, false, true)
}

func (d *sidekiqDelivery[J]) runStarted() {
	d.began.Store(true)
	if d.t.begin != nil {
		d.t.begin(d.job)
	}
}

func (d *sidekiqDelivery[J]) runEnded(failed bool) {
	if d.t.end != nil {
		d.t.end(d.job, failed)
	}
}

// failed hands the job of a failed run to Sidekiq's retry: the retry set
// with its backoff, the dead set once its retries are used up (or dropped,
// with retry: false).
func (d *sidekiqDelivery[J]) failed(ctx context.Context, class, message string, backtrace []string) error {
	return d.settle(func() error {
		out, err := d.t.client.Retry(ctx, d.job, class, clip.String(message, maxDetail), backtrace)
		d.outcome.Store(int32(out))
		return err
	}, false, true)
}

// keep: a held record keeps the job as fetched and its queue
// (DecodeHeldSidekiq), to push it again.
func (d *sidekiqDelivery[J]) keep() ([]byte, error) {
	if d.v.Raw == "" || d.v.Queue == "" {
		return nil, errors.New("a Sidekiq job without its raw form or queue is not kept for replay")
	}
	return json.Marshal(heldSidekiq{Queue: d.v.Queue, Job: d.v.Raw, CapturedAt: time.Now().UTC()})
}

// heldSidekiq is the form of a Sidekiq job kept in a held record.
type heldSidekiq struct {
	Queue      string    `json:"sidekiq_queue"`
	Job        string    `json:"sidekiq_job"`
	CapturedAt time.Time `json:"captured_at"`
}

// DecodeHeldSidekiq reads the job kept in a held record of a Sidekiq job
// (idempotency Record.Message): its queue and the job as it was fetched,
// to push it again (sidekiq.Producer.PushRaw). ok is false for a record
// that keeps a Celery message (DecodeHeld) or nothing.
func DecodeHeldSidekiq(b []byte) (queue, job string, ok bool) {
	var h heldSidekiq
	if json.Unmarshal(b, &h) != nil || h.Queue == "" || h.Job == "" {
		return "", "", false
	}
	return h.Queue, h.Job, true
}

// The Sidekiq transport is a transport, and its deliveries are deliveries,
// whatever its client's job type.
var (
	_ transport = (*sidekiqTransport[*sidekiqJob])(nil)
	_ delivery  = (*sidekiqDelivery[*sidekiqJob])(nil)
	_ transport = (*sidekiqWorkerTransport)(nil)
	_ runMarker = (*sidekiqDelivery[*sidekiqJob])(nil)

	_ retryOutcomer = (*sidekiqDelivery[*sidekiqJob])(nil)

	_ failingDelivery = (*sidekiqDelivery[*sidekiqJob])(nil)
	_ transport       = (*amqpTransport)(nil)
	_ delivery        = (*amqpDelivery)(nil)
)
