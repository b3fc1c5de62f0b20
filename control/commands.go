package control

import (
	"errors"
	"fmt"
	"math"
	"net/url"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/celeryproto"
)

// Celery's run-time commands (celery/worker/control.py): rate and time
// limits, queues, the pool, and the debugging ones. Each answers in the
// shape Celery's does: {"ok": text}, {"error": text}, or for a command that
// raises in Celery, {"error": repr(exception)} as kombu's pidbox answers.

// pyError is kombu's answer to a command that raised: {"error": repr(exc)}.
func pyError(class, msg string) map[string]any {
	return nok(class + "(" + celeryproto.StringRepr(msg) + ")")
}

// tuning runs the commands of this file; handled is false for any other.
func (c *Controller) tuning(req *celeryproto.ControlRequest) (result any, handled bool) {
	args := req.Arguments
	switch req.Method {
	case "rate_limit":
		return c.rateLimit(str(args["task_name"]), rateArg(args["rate_limit"])), true
	case "time_limit":
		return c.timeLimit(str(args["task_name"]), seconds(args["soft"]), seconds(args["hard"])), true
	case "add_consumer":
		return c.addConsumer(args), true
	case "cancel_consumer":
		name := str(args["queue"])
		t, isT := c.worker().(Tuner)
		if !isT {
			return notSupported(req.Method), true
		}
		if err := t.CancelQueue(name); err != nil {
			c.log.Warn("cancel_consumer", zap.String("queue", name), zap.Error(err))
			return pyError("ValueError", err.Error()), true
		}
		c.log.Info("no longer consuming from a queue, by remote", zap.String("queue", name))
		return ok("no longer consuming from " + name), true
	case "pool_grow", "pool_shrink":
		t, isT := c.worker().(Tuner)
		if !isT {
			return notSupported(req.Method), true
		}
		n := intArg(args["n"], 1)
		if req.Method == "pool_shrink" {
			n = -max(n, -math.MaxInt)
		}
		size := t.SetPoolSize(addSat(t.PoolSize(), n))
		c.log.Info("task slots changed by remote", zap.String("command", req.Method), zap.Int("slots", size))
		if n < 0 {
			return ok("pool will shrink"), true
		}
		return ok("pool will grow"), true
	case "autoscale":
		t, isT := c.worker().(Tuner)
		if !isT {
			return pyError("ValueError", "Autoscale not enabled"), true
		}
		hi := intArg(args["max"], t.PoolSize())
		lo := min(intArg(args["min"], hi), hi)
		size := t.SetPoolSize(hi)
		c.log.Info("task slots changed by remote autoscale", zap.Int("slots", size))
		return ok(fmt.Sprintf("autoscale now max=%d min=%d", size, lo)), true
	case "pool_restart":
		return pyError("ValueError", "Pool restarts not supported: onceler runs tasks in goroutines of one process, "+
			"there is no pool to restart (restart the worker to load new code)"), true
	case "objgraph":
		return pyError("NotImplementedError", "objgraph is not supported: onceler is a Go program "+
			"(use memdump, memsample or the Go pprof profiles)"), true
	case "memsample":
		return c.mem.sample(), true
	case "memdump":
		return c.mem.dump(intArg(args["samples"], 10)), true
	case "report":
		return ok(c.report()), true
	}
	return nil, false
}

func notSupported(method string) map[string]any {
	return nok(method + " is not supported by this worker")
}

func (c *Controller) rateLimit(task string, rate string) any {
	if _, err := ParseRate(rate); err != nil {
		return nok("Invalid rate limit string: " + rateErrorRepr(rate))
	}
	t, isT := c.worker().(Tuner)
	if !isT {
		return notSupported("rate_limit")
	}
	if err := t.SetRateLimit(task, rate); err != nil {
		if errors.Is(err, ErrUnknownTask) {
			c.log.Error("rate limit attempt for unknown task", zap.String("task", task))
			return nok("unknown task")
		}
		return nok(err.Error())
	}
	if r, _ := ParseRate(rate); r == 0 {
		c.log.Info("rate limits disabled by remote", zap.String("task", task))
		return ok("rate limit disabled successfully")
	}
	c.log.Info("new rate limit by remote", zap.String("task", task), zap.String("rate_limit", rate))
	return ok("new rate limit set successfully")
}

func (c *Controller) timeLimit(task string, soft, hard time.Duration) any {
	t, isT := c.worker().(Tuner)
	if !isT {
		return notSupported("time_limit")
	}
	if err := t.SetTimeLimit(task, soft, hard); err != nil {
		if errors.Is(err, ErrUnknownTask) {
			c.log.Error("time limit change attempt for unknown task", zap.String("task", task))
			return nok("unknown task")
		}
		return nok(err.Error())
	}
	c.log.Info("new time limits by remote", zap.String("task", task), zap.Duration("soft", soft), zap.Duration("hard", hard))
	return ok("time limits set successfully")
}

// addConsumer declares the queue as Celery's add_consumer does (a durable
// queue bound to the exchange, by default its own name, direct) and
// consumes it.
func (c *Controller) addConsumer(args map[string]any) any {
	name := str(args["queue"])
	if name == "" {
		return pyError("TypeError", "add_consumer() missing 1 required positional argument: 'queue'")
	}
	t, isT := c.worker().(Tuner)
	if !isT {
		return notSupported("add_consumer")
	}
	q := amqp.CeleryQueue(name)
	if ex := str(args["exchange"]); ex != "" {
		q.Exchange = ex
	}
	if typ := str(args["exchange_type"]); typ != "" {
		q.ExchangeType = typ
	}
	if key := str(args["routing_key"]); key != "" {
		q.RoutingKey = key
	}
	if err := t.AddQueue(q); err != nil {
		c.log.Warn("add_consumer", zap.String("queue", name), zap.Error(err))
		return pyError("ValueError", err.Error())
	}
	c.log.Info("consuming a queue, by remote", zap.String("queue", name))
	return ok("add consumer " + name)
}

// ParseRate reads a rate limit in Celery's syntax: "N" or "N/s" per
// second, "N/m" per minute, "N/h" per hour; "" and 0 mean no limit. It
// returns the rate per second.
func ParseRate(s string) (float64, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return 0, nil
	}
	ops, unit, _ := strings.Cut(s, "/")
	n, err := strconv.ParseFloat(strings.TrimSpace(ops), 64)
	if err != nil || math.IsNaN(n) || math.IsInf(n, 0) || n < 0 {
		return 0, fmt.Errorf("control: rate limit %q: %q is not a number", s, ops)
	}
	switch unit {
	case "", "s":
		return n, nil
	case "m":
		return n / 60, nil
	case "h":
		return n / 3600, nil
	}
	return 0, fmt.Errorf("control: rate limit %q: unit %q is not s, m or h", s, unit)
}

// rateErrorRepr is the repr of the exception Celery's rate() raises for s.
func rateErrorRepr(s string) string {
	ops, unit, _ := strings.Cut(strings.TrimSpace(s), "/")
	if _, err := strconv.ParseFloat(strings.TrimSpace(ops), 64); err != nil {
		return "ValueError(" + celeryproto.StringRepr("could not convert string to float: "+celeryproto.StringRepr(ops)) + ")"
	}
	if unit != "" && unit != "s" && unit != "m" && unit != "h" {
		return "KeyError(" + celeryproto.StringRepr(unit) + ")"
	}
	return "ValueError(" + celeryproto.StringRepr("rate limit "+s+" is negative or not finite") + ")"
}

func str(v any) string {
	switch x := v.(type) {
	case string:
		return x
	case nil:
		return ""
	}
	return fmt.Sprint(v)
}

// rateArg is a rate limit given as a string or a number (app.control.rate_limit
// takes either).
func rateArg(v any) string {
	switch x := v.(type) {
	case float64:
		return strconv.FormatFloat(x, 'f', -1, 64)
	case int64:
		return strconv.FormatInt(x, 10)
	}
	return str(v)
}

// seconds reads a time limit in seconds (None: 0).
func seconds(v any) time.Duration {
	var f float64
	switch x := v.(type) {
	case float64:
		f = x
	case int64:
		f = float64(x)
	case string:
		f, _ = strconv.ParseFloat(x, 64)
	}
	if f <= 0 || math.IsNaN(f) || f > 1e9 {
		return 0
	}
	return time.Duration(f * float64(time.Second))
}

// addSat is a+b, saturated at the ends of int (pool_grow by 2**63-1).
func addSat(a, b int) int {
	switch {
	case b > 0 && a > math.MaxInt-b:
		return math.MaxInt
	case b < 0 && a < math.MinInt-b:
		return math.MinInt
	}
	return a + b
}

// intArg reads an integer argument; a float beyond int saturates.
func intArg(v any, def int) int {
	switch x := v.(type) {
	case int64:
		return int(x)
	case float64:
		switch {
		case math.IsNaN(x):
			return def
		case x >= math.MaxInt:
			return math.MaxInt
		case x <= math.MinInt:
			return math.MinInt
		}
		return int(x)
	case string:
		if n, err := strconv.Atoi(x); err == nil {
			return n
		}
	}
	return def
}

// memSamples keeps memsample's samples for memdump, as Celery's
// celery.utils.debug does.
type memSamples struct {
	mu      sync.Mutex
	samples []string
}

const maxMemSamples = 10000

// memRSS is the memory the Go runtime holds from the system and has not
// returned (runtime.MemStats: Sys - HeapReleased), in Celery's humanbytes.
func memRSS() string {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return humanBytes(float64(ms.Sys - ms.HeapReleased))
}

func (m *memSamples) sample() string {
	s := memRSS()
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.samples) >= maxMemSamples {
		m.samples = slices.Delete(m.samples, 0, 1)
	}
	m.samples = append(m.samples, s)
	return s
}

// dump is Celery's memdump text: a sample of at most n of the samples
// taken since the last dump, then the memory after a collection.
func (m *memSamples) dump(n int) string {
	m.mu.Lock()
	prev := m.samples
	m.samples = nil
	m.mu.Unlock()
	if n > 0 && len(prev) > n {
		// Celery's sample(): every len/n-th
		step := len(prev) / n
		picked := make([]string, 0, n)
		for i := 0; i < len(prev) && len(picked) < n; i += step {
			picked = append(picked, prev[i])
		}
		prev = picked
	}
	runtime.GC()
	var b strings.Builder
	if len(prev) > 0 {
		b.WriteString("- rss (sample):\n")
		for _, s := range prev {
			fmt.Fprintf(&b, "-    > %s,\n", s)
		}
	}
	fmt.Fprintf(&b, "- rss (end): %s.\n", memRSS())
	return b.String()
}

// humanBytes is Celery's humanbytes: "52.344MB", "12KB", "100b".
func humanBytes(n float64) string {
	units := []struct {
		div  float64
		unit string
	}{{1 << 40, "TB"}, {1 << 30, "GB"}, {1 << 20, "MB"}, {1 << 10, "KB"}, {0, "b"}}
	for _, u := range units {
		if n >= u.div {
			v := n
			if u.div > 0 {
				v = n / u.div
			}
			return hfloat(v) + u.unit
		}
	}
	return hfloat(n) + "b"
}

// hfloat is Celery's hfloat: an integral value as an integer, else five
// significant digits.
func hfloat(f float64) string {
	if f == math.Trunc(f) {
		return strconv.FormatInt(int64(f), 10)
	}
	s := strconv.FormatFloat(f, 'g', 5, 64)
	if !strings.ContainsAny(s, ".e") {
		s += ".0"
	}
	return s
}

// report is Celery's bugreport text for this worker: software, platform,
// loader, transport and results, then the settings.
func (c *Controller) report() string {
	var settings map[string]any
	if t, isT := c.worker().(Tuner); isT {
		settings = t.Settings(false)
	} else {
		settings = c.conf(false)
	}
	results := "disabled://"
	if r, ok := settings["result_backend"].(string); ok && r != "" {
		results = r
	}
	var uts syscall.Utsname
	release, system := "", "Linux"
	if err := syscall.Uname(&uts); err == nil {
		release = utsString(uts.Release[:])
		system = utsString(uts.Sysname[:])
	}
	var b strings.Builder
	fmt.Fprintf(&b, "\nsoftware -> onceler:%s go:%s\n", Version, runtime.Version())
	fmt.Fprintf(&b, "platform -> system:%s arch:%s\n            kernel version:%s imp:%s\n", system, runtime.GOARCH, release, runtime.Compiler)
	fmt.Fprintf(&b, "loader   -> github.com/onceler/onceler/tasks.Registry\n")
	fmt.Fprintf(&b, "settings -> transport:amqp results:%s\n\n", results)
	for _, k := range slices.Sorted(func(yield func(string) bool) {
		for k := range settings {
			if !yield(k) {
				return
			}
		}
	}) {
		fmt.Fprintf(&b, "%s: %s\n", k, celeryproto.Repr(settings[k]))
	}
	return b.String()
}

func utsString[T int8 | uint8](a []T) string {
	b := make([]byte, 0, len(a))
	for _, c := range a {
		if c == 0 {
			break
		}
		b = append(b, byte(c))
	}
	return string(b)
}

// conf is the conf command's answer for a worker that is no Tuner: what the
// controller knows of it, under Celery's names.
func (c *Controller) conf(withDefaults bool) map[string]any {
	out := map[string]any{
		"broker_url":                 amqp.RedactURL(c.cfg.URL),
		"worker_concurrency":         c.cfg.Concurrency,
		"worker_send_task_events":    c.TaskEvents(),
		"worker_prefetch_multiplier": max(1, c.cfg.Prefetch/max(1, c.cfg.Concurrency)),
	}
	if withDefaults {
		out["event_exchange"] = EventExchange
		out["control_exchange"] = "celery"
	}
	return out
}

// BrokerInfo is kombu's Connection.info() for a broker URL, without the
// password, as Celery's inspect stats gives it under "broker": heartbeat
// and connectTimeout as the connection uses them; "url" (onceler's) is the
// URL with its password redacted.
func BrokerInfo(rawURL string, heartbeat, connectTimeout time.Duration) map[string]any {
	urls := strings.Split(rawURL, ";")
	info := map[string]any{
		"hostname": "localhost", "userid": "guest", "virtual_host": "/", "port": 5672,
		"insist": false, "ssl": false, "transport": "amqp", "connect_timeout": connectTimeout.Seconds(),
		"transport_options": map[string]any{}, "login_method": "PLAIN", "uri_prefix": nil,
		"heartbeat": heartbeat.Seconds(), "failover_strategy": "round-robin", "alternates": []any{},
		"url": amqp.RedactURL(rawURL),
	}
	if len(urls) > 1 {
		alts := make([]any, 0, len(urls)-1)
		for _, a := range urls[1:] {
			alts = append(alts, amqp.RedactURL(strings.TrimSpace(a)))
		}
		info["alternates"] = alts
	}
	u, err := url.Parse(strings.TrimSpace(urls[0]))
	if err != nil {
		return info
	}
	if u.Scheme == "amqps" {
		info["ssl"], info["port"] = true, 5671
	}
	if h := u.Hostname(); h != "" {
		info["hostname"] = h
	}
	if p, err := strconv.Atoi(u.Port()); err == nil {
		info["port"] = p
	}
	if u.User != nil && u.User.Username() != "" {
		info["userid"] = u.User.Username()
	}
	if vh := strings.TrimPrefix(u.Path, "/"); vh != "" {
		if v, err := url.PathUnescape(vh); err == nil {
			info["virtual_host"] = v
		}
	}
	return info
}
