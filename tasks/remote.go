package tasks

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strings"

	"go.uber.org/zap"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/control"
)

// The worker's remote control: a control.Controller of its own (unless
// Config.NoControl), on a connection of its own to the broker, under the
// worker's node name, for as long as Run runs.

// newControl makes the worker's remote control.
func (w *Worker) newControl() error {
	if _, ok := w.cfg.Observer.(*control.Controller); ok {
		return errors.New("tasks: Config.Observer is a control.Controller while the worker runs one of its own: set Config.NoControl to run yours")
	}
	cc, err := controlConfig(&w.cfg)
	if err != nil {
		return fmt.Errorf("tasks: remote control: %w", err)
	}
	cc.Shutdown = w.shutdown
	ctl, err := control.New(w, cc)
	if err != nil {
		return fmt.Errorf("tasks: remote control (Config.NoControl turns it off): %w", err)
	}
	w.ctl = ctl
	return nil
}

// controlConfig configures the remote control like the worker (defaults
// applied): the same broker and TLS (CA and client certificate), the node
// name, the queues, concurrency and prefetch ('celery inspect stats',
// 'active_queues', 'conf'), the revoked ids' expiry, its logger.
func controlConfig(cfg *Config) (control.Config, error) {
	tc, err := cfg.Broker.TLSClientConfig()
	if err != nil {
		return control.Config{}, err
	}
	return control.Config{
		URL:         brokerURL(cfg.Broker),
		TLS:         tc,
		NodeName:    cfg.Hostname,
		TaskEvents:  cfg.TaskEvents,
		Concurrency: cfg.Concurrency,
		Prefetch:    cfg.Prefetch,
		RevokedTTL:  cfg.RevokedExpiry,
		Logger:      cfg.Logger.Named("control"),
	}, nil
}

// brokerURL is the broker's failover list (Config.URLs, or URL) in
// Celery's spelling: the URLs separated by ';'.
func brokerURL(c amqp.Config) string { return strings.Join(c.Addresses(), ";") }

// shutdown is the remote shutdown command: Run stops as when its context
// is cancelled.
func (w *Worker) shutdown() {
	if stop := w.stopRun.Load(); stop != nil {
		(*stop)()
	}
}

// runControl runs the remote control, if any, until the function it
// returns is called, which sends worker-offline and waits for it.
func (w *Worker) runControl(ctx context.Context) (stop func()) {
	if w.ctl == nil {
		return func() {}
	}
	cctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := w.ctl.Run(cctx); err != nil {
			w.log.Error("remote control stopped", zap.Error(err))
		}
	}()
	return func() {
		cancel()
		<-done
	}
}

// withControl is the Observer of a worker with remote control ctl and the
// user's Observer user (nil: none).
func withControl(user Observer, ctl *control.Controller) Observer {
	if user == nil {
		return ctl
	}
	b := &bothObservers{user: user, ctl: ctl}
	if te, ok := user.(interface{ TaskEvents() bool }); ok {
		b.userOn = te.TaskEvents
	}
	b.userTE, _ = user.(TaskEventObserver)
	return b
}

// bothObservers hands each task event to the user's Observer (when it
// wants them) and to the remote control (while its task events are on).
type bothObservers struct {
	user   Observer
	userOn func() bool       // the user's TaskEvents method; nil: always on
	userTE TaskEventObserver // the user's Observer when it takes values
	ctl    *control.Controller
}

var _ TaskEventObserver = (*bothObservers)(nil)

func (b *bothObservers) userWants() bool { return b.userOn == nil || b.userOn() }

// TaskEvents reports whether either wants task events now.
func (b *bothObservers) TaskEvents() bool { return b.userWants() || b.ctl.TaskEvents() }

// Event hands each its own map: an Observer owns what it is given.
func (b *bothObservers) Event(ctx context.Context, typ string, fields map[string]any) {
	if b.ctl.TaskEvents() {
		b.ctl.Event(ctx, typ, maps.Clone(fields))
	}
	if b.userWants() {
		b.user.Event(ctx, typ, fields)
	}
}

// TaskEvent hands each its own value.
func (b *bothObservers) TaskEvent(ctx context.Context, e *celeryproto.TaskEvent) {
	if b.ctl.TaskEvents() {
		cp := *e
		b.ctl.TaskEvent(ctx, &cp)
	}
	if !b.userWants() {
		return
	}
	if b.userTE != nil {
		b.userTE.TaskEvent(ctx, e)
		return
	}
	b.user.Event(ctx, e.Type, e.Fields())
}
