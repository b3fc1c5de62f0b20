package cmd

import (
	"context"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/onceler/onceler/amqp"
)

// queueSpecs are the queues of --queues, each with the arguments of
// --queue-arg and --quorum for when it is missing.
func (f *workerFlags) queueSpecs() ([]amqp.QueueSpec, error) {
	var names []string
	for _, name := range strings.Split(f.queues, ",") {
		if name = strings.TrimSpace(name); name != "" && !slices.Contains(names, name) {
			names = append(names, name)
		}
	}
	if len(names) == 0 {
		return nil, usagef("worker", "--queues names no queue")
	}
	args, err := parseQueueArgs(f.queueArgs, names)
	if err != nil {
		return nil, err
	}
	specs := make([]amqp.QueueSpec, len(names))
	for i, name := range names {
		q := amqp.CeleryQueue(name)
		q.Args, q.Quorum = args[name], f.quorum
		if t, ok := q.Args["x-queue-type"]; ok && f.quorum && t != "quorum" {
			return nil, usagef("worker", "--quorum and --queue-arg x-queue-type=%v disagree for queue %s", t, name)
		}
		specs[i] = q
	}
	return specs, nil
}

// argItem is ARG=VALUE: an argument name is letters, digits, '.', '_' and
// '-'; a value is anything but ','. queueArgItem is QUEUE:ARG=VALUE, for
// the message that names a queue not among --queues.
var (
	argItem      = regexp.MustCompile(`^([A-Za-z0-9._-]+)=(.*)$`)
	queueArgItem = regexp.MustCompile(`^([^=]*):[A-Za-z0-9._-]+=`)
)

// parseQueueArgs reads the --queue-arg items ([QUEUE:]ARG=VALUE) into
// arguments by queue; a later item wins. An item is for one queue when it
// begins with the name of one of names and ':' (the longest such name),
// else for every queue of names: a queue name may hold ':' and '=', and so
// may a value.
func parseQueueArgs(items, names []string) (map[string]map[string]any, error) {
	out := map[string]map[string]any{}
	for _, item := range items {
		targets, rest := names, item
		best := ""
		for _, q := range names {
			if len(q) > len(best) && strings.HasPrefix(item, q+":") && argItem.MatchString(item[len(q)+1:]) {
				best = q
			}
		}
		if best != "" {
			targets, rest = []string{best}, item[len(best)+1:]
		}
		m := argItem.FindStringSubmatch(rest)
		if m == nil {
			if qm := queueArgItem.FindStringSubmatch(item); qm != nil {
				return nil, usagef("worker", "invalid --queue-arg %q: queue %q is not among --queues", item, qm[1])
			}
			return nil, usagef("worker", "invalid --queue-arg %q: use ARG=VALUE or QUEUE:ARG=VALUE, e.g. x-max-priority=10", item)
		}
		for _, q := range targets {
			if out[q] == nil {
				out[q] = map[string]any{}
			}
			out[q][m[1]] = queueArgValue(m[2])
		}
	}
	return out, nil
}

// queueArgValue types a --queue-arg value as RabbitMQ wants it: an integer
// as an integer (x-max-priority, x-message-ttl, x-max-length, ...), true
// or false as a boolean, a value in double quotes as the string inside,
// anything else as a string.
func queueArgValue(s string) any {
	if len(s) >= 2 && s[0] == '"' && s[len(s)-1] == '"' {
		return s[1 : len(s)-1]
	}
	if n, err := strconv.ParseInt(s, 10, 64); err == nil {
		return n
	}
	if b, err := strconv.ParseBool(s); err == nil && (s == "true" || s == "false") {
		return b
	}
	return s
}

// probeBroker checks that the broker answers and makes sure every queue
// exists as the worker will (a queue that exists is left as it is, a
// missing one is declared with --queue-arg and --quorum), so that a wrong
// URL fails at once with one clear line instead of a reconnect loop. It
// returns the queues as found.
func probeBroker(ctx context.Context, cfg amqp.Config, queues []amqp.QueueSpec) ([]amqp.QueueSpec, error) {
	where := amqp.RedactURL(cfg.URL)
	cfg.Logger = nil
	cfg.MaxBackoff = time.Second
	if cfg.Name != "" {
		cfg.Name += ".probe"
	}
	p := amqp.NewPublisher(cfg)
	defer func() { _ = p.Close() }()
	pctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	found := make([]amqp.QueueSpec, len(queues))
	for i, q := range queues {
		fq, err := p.DeclareQueue(pctx, q)
		switch {
		case err == nil:
			found[i] = fq
		case isPrecondition(err):
			return nil, fmt.Errorf("queue %s is missing on %s and the broker refuses to declare it with these arguments (check --queue-arg and --quorum): %s", q.Name, where, oneLine(err))
		default:
			return nil, brokerError("worker", cfg, amqp.AccessFor(err, "consuming queue "+q.Name))
		}
	}
	return found, nil
}

// priorityQueues names the priority queues (x-max-priority) among queues.
func priorityQueues(queues []amqp.QueueSpec) []string {
	var out []string
	for _, q := range queues {
		if q.MaxPriority() > 0 {
			out = append(out, q.Name)
		}
	}
	return out
}
