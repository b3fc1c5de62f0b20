package control

import (
	"context"
	"fmt"
	"maps"
	"os"
	"path"
	"regexp"
	"slices"
	"syscall"
	"time"

	amqp091 "github.com/onceler/onceler/internal/amqp091"
	"go.uber.org/zap"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
)

const (
	replyTimeout = 5 * time.Second
	// controlHeartbeat is the AMQP heartbeat of the controller's connection.
	controlHeartbeat = 10 * time.Second
)

// handle answers one pidbox request: decode, select by destination or
// pattern, dispatch, and reply when the request asks for it.
func (c *Controller) handle(ctx context.Context, ch *amqp091.Channel, d *amqp091.Delivery) {
	req, err := celeryproto.DecodeControl(&celeryproto.Delivery{
		ContentType:     d.ContentType,
		ContentEncoding: d.ContentEncoding,
		Headers:         d.Headers,
		Body:            d.Body,
	})
	if err != nil {
		// no-ack queue: there is nothing to requeue, and kombu drops an
		// undecodable control message too; say so.
		c.log.Warn("control message not decodable: dropped", zap.String("reason", celeryproto.Reason(err)))
		return
	}
	c.adjustClock(req.Clock)
	if !c.selected(req) {
		return
	}
	c.commands.Add(1)
	c.log.Debug("control command", zap.String("method", req.Method), zap.Bool("reply", req.WantsReply()))
	result, after := c.dispatch(ctx, req)
	if req.WantsReply() {
		c.reply(ctx, ch, req, result)
	}
	if after != nil {
		after()
	}
}

func (c *Controller) adjustClock(other int64) {
	for {
		cur := c.clock.Load()
		next := max(cur, other) + 1
		if c.clock.CompareAndSwap(cur, next) {
			return
		}
	}
}

// selected applies kombu's Node.handle_message rules: a destination list
// names the node; else a pattern with a matcher ("glob" or "pcre") must
// match; else every node handles it.
func (c *Controller) selected(req *celeryproto.ControlRequest) bool {
	node := c.cfg.NodeName
	if len(req.Destination) > 0 {
		return slices.Contains(req.Destination, node)
	}
	if req.Pattern == "" || req.Matcher == "" {
		return true
	}
	switch req.Matcher {
	case "glob":
		ok, err := path.Match(req.Pattern, node)
		return err == nil && ok
	case "pcre":
		re, err := regexp.Compile(`^(?:` + req.Pattern + `)`)
		return err == nil && re.MatchString(node)
	}
	return false
}

// aliases are the old names Celery's commands still answer to.
var aliases = map[string]string{
	"dump_conf": "conf", "dump_schedule": "scheduled", "dump_reserved": "reserved",
	"dump_active": "active", "dump_revoked": "revoked", "dump_tasks": "registered",
}

func ok(v string) map[string]any  { return map[string]any{"ok": v} }
func nok(v string) map[string]any { return map[string]any{"error": v} }

// dispatch runs a command and returns its reply, and an action to run after
// replying (shutdown).
func (c *Controller) dispatch(ctx context.Context, req *celeryproto.ControlRequest) (any, func()) {
	node := c.cfg.NodeName
	if m, ok := aliases[req.Method]; ok {
		req.Method = m
	}
	switch req.Method {
	case "ping":
		return ok("pong"), nil
	case "registered":
		names := c.worker().Registered()
		out := make([]any, 0, len(names))
		for _, n := range slices.Sorted(slices.Values(names)) {
			out = append(out, n)
		}
		return out, nil
	case "active":
		return requests(c.worker().Active(), node, truthy(req.Arguments["safe"])), nil
	case "reserved":
		return requests(c.worker().Reserved(), node, truthy(req.Arguments["safe"])), nil
	case "scheduled":
		ts := c.worker().Scheduled()
		out := make([]any, 0, len(ts))
		for _, t := range ts {
			out = append(out, t.scheduled(node, truthy(req.Arguments["safe"])))
		}
		return out, nil
	case "stats":
		return c.stats(), nil
	case "active_queues":
		return c.activeQueues(), nil
	case "revoke":
		return c.revoke(ctx, req.Arguments["task_id"], truthy(req.Arguments["terminate"])), nil
	case "terminate":
		return c.revoke(ctx, req.Arguments["task_id"], true), nil
	case "revoked":
		ids := c.revoked.IDs()
		out := make([]any, len(ids))
		for i, id := range ids {
			out[i] = id
		}
		return out, nil
	case "enable_events":
		if c.SetTaskEvents(true) {
			c.log.Info("task events enabled by remote")
			return ok("task events enabled"), nil
		}
		return ok("task events already enabled"), nil
	case "disable_events":
		if c.SetTaskEvents(false) {
			c.log.Info("task events disabled by remote")
			return ok("task events disabled"), nil
		}
		return ok("task events already disabled"), nil
	case "heartbeat":
		c.sendWorkerEvent("worker-heartbeat")
		return nil, nil
	case "query_task":
		return c.queryTask(req.Arguments["ids"], truthy(req.Arguments["safe"])), nil
	case "conf":
		withDefaults := truthy(req.Arguments["with_defaults"])
		if t, ok := c.worker().(Tuner); ok {
			conf := t.Settings(withDefaults)
			delete(conf, "worker_send_task_events") // as enable_events and disable_events left it
			if withDefaults || c.TaskEvents() {
				conf["worker_send_task_events"] = c.TaskEvents()
			}
			return conf, nil
		}
		return c.conf(withDefaults), nil
	case "clock":
		return map[string]any{"clock": c.clock.Load()}, nil
	case "hello":
		from, _ := req.Arguments["from_node"].(string)
		if from == node {
			return nil, nil
		}
		if r, ok := req.Arguments["revoked"].(map[string]any); ok {
			c.mergeRevoked(r)
		}
		return map[string]any{"revoked": c.revoked.limitedSetData(), "clock": c.clock.Add(1)}, nil
	case "shutdown":
		if c.cfg.Shutdown == nil {
			return nok("shutdown is not enabled on this worker"), nil
		}
		c.log.Warn("shutdown requested by remote")
		return ok("shutting down"), c.cfg.Shutdown
	}
	if result, handled := c.tuning(req); handled {
		return result, nil
	}
	return nok(fmt.Sprintf("unknown command %q", req.Method)), nil
}

// queryTask answers Celery's query_task: {id: [state, request]} for the
// given ids the worker holds ("active" or "reserved").
func (c *Controller) queryTask(arg any, safe bool) map[string]any {
	want := map[string]bool{}
	switch v := arg.(type) {
	case string:
		want[v] = true
	case []any:
		for _, x := range v {
			if s, ok := x.(string); ok {
				want[s] = true
			}
		}
	}
	out := map[string]any{}
	w, node := c.worker(), c.cfg.NodeName
	for state, list := range map[string][]TaskInfo{"reserved": w.Reserved(), "active": w.Active()} {
		for _, t := range list {
			if want[t.ID] {
				out[t.ID] = []any{state, t.request(node, safe)}
			}
		}
	}
	return out
}

func truthy(v any) bool {
	switch x := v.(type) {
	case bool:
		return x
	case int64:
		return x != 0
	case float64:
		return x != 0
	case string:
		return x != "" && x != "0" && x != "false" && x != "False"
	}
	return false
}

func (c *Controller) reply(ctx context.Context, ch *amqp091.Channel, req *celeryproto.ControlRequest, result any) {
	p, err := celeryproto.EncodeControlReply(c.cfg.NodeName, result, req.Ticket, c.clock.Add(1))
	if err != nil {
		c.log.Error("control reply not encodable", zap.String("method", req.Method), zap.Error(err))
		p, _ = celeryproto.EncodeControlReply(c.cfg.NodeName, nok("reply not encodable"), req.Ticket, c.clock.Add(1))
	}
	exchange := req.ReplyExchange
	if err := c.declareReply(ch, exchange); err != nil {
		c.log.Warn("control reply exchange", zap.String("exchange", exchange), zap.Error(err))
		return
	}
	pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), replyTimeout)
	defer cancel()
	if err := ch.PublishWithContext(pctx, exchange, req.ReplyRoutingKey, false, false, publishing(p)); err != nil {
		c.log.Warn("control reply not sent", zap.String("method", req.Method), zap.Error(err))
	}
}

// declareReply declares a reply exchange as kombu does (direct, not
// durable) the first time this session replies to it.
func (c *Controller) declareReply(ch *amqp091.Channel, exchange string) error {
	if exchange == "" {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.declared[exchange] {
		return nil
	}
	if err := ch.ExchangeDeclare(exchange, "direct", false, false, false, false, nil); err != nil {
		return fmt.Errorf("declare %s: %w", exchange, err)
	}
	c.declared[exchange] = true
	return nil
}

func (c *Controller) stats() map[string]any {
	var ru syscall.Rusage
	rusage := map[string]any{}
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err == nil {
		rusage = map[string]any{
			"utime": float64(ru.Utime.Sec) + float64(ru.Utime.Usec)/1e6, "stime": float64(ru.Stime.Sec) + float64(ru.Stime.Usec)/1e6,
			"maxrss": ru.Maxrss, "minflt": ru.Minflt, "majflt": ru.Majflt, "nvcsw": ru.Nvcsw, "nivcsw": ru.Nivcsw,
			"inblock": ru.Inblock, "oublock": ru.Oublock,
		}
	}
	sent, dropped, commands := c.Counters()
	out := map[string]any{
		"total":          map[string]any{},
		"pid":            os.Getpid(),
		"clock":          c.clock.Load(),
		"uptime":         int64(time.Since(c.started).Seconds()),
		"prefetch_count": c.cfg.Prefetch,
		"pool": map[string]any{
			"implementation":  "onceler:goroutines",
			"max-concurrency": c.cfg.Concurrency,
			"processes":       []any{os.Getpid()},
		},
		"broker":   BrokerInfo(c.cfg.URL, controlHeartbeat, c.cfg.DialTimeout),
		"rusage":   rusage,
		"events":   map[string]any{"enabled": c.TaskEvents(), "sent": sent, "dropped": dropped},
		"control":  map[string]any{"commands": commands, "revoked": c.revoked.Len()},
		"sw_ident": "onceler", "sw_ver": Version,
	}
	for k, v := range c.worker().Stats() {
		out[k] = v
	}
	return out
}

// activeQueues lists the worker's queues as kombu's
// Queue.as_dict(recurse=True), with the arguments found on the broker.
func (c *Controller) activeQueues() []any {
	queues := c.worker().Queues()
	out := make([]any, 0, len(queues))
	for _, q := range queues {
		ex, typ, key := q.Exchange, q.ExchangeType, q.RoutingKey
		switch ex {
		case "":
			ex = q.Name
		case amqp.DefaultExchange:
			ex = ""
		}
		if typ == "" {
			typ = "direct"
		}
		if key == "" {
			key = q.Name
		}
		var args any
		if a := queueArguments(q); len(a) > 0 {
			args = a
		}
		out = append(out, map[string]any{
			"name": q.Name,
			"exchange": map[string]any{
				"name": ex, "type": typ, "arguments": nil, "durable": true, "passive": false,
				"auto_delete": false, "delivery_mode": nil, "no_declare": false,
			},
			"routing_key": key, "queue_arguments": args, "binding_arguments": nil, "consumer_arguments": nil,
			"durable": q.Durable, "exclusive": false, "auto_delete": q.AutoDelete, "no_ack": false,
			"alias": nil, "bindings": []any{}, "no_declare": nil, "expires": nil, "message_ttl": nil,
			"max_length": nil, "max_length_bytes": nil, "max_priority": nil,
		})
	}
	return out
}

// queueArguments are q's arguments, with x-queue-type quorum for a spec
// that says Quorum.
func queueArguments(q amqp.QueueSpec) map[string]any {
	if !q.Quorum {
		return q.Args
	}
	args := make(map[string]any, len(q.Args)+1)
	maps.Copy(args, q.Args)
	args["x-queue-type"] = "quorum"
	return args
}
