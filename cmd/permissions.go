package cmd

import (
	"context"
	"fmt"
	"regexp"
	"strings"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/control"
	amqp091 "github.com/onceler/onceler/internal/amqp091"
)

func permissionsCommand() *command {
	return &command{
		name:    "permissions",
		summary: "print the rabbitmqctl lines that give a worker's RabbitMQ user what it needs, and no more",
		long: `Prints the rabbitmqctl commands that create the vhost and user of
--broker-url and give the user the permissions a worker with the same
--queues, --hostname and --no-control needs, and no others: run it with the
worker's flags or environment. Nothing is sent to the broker; the password
is never printed.

configure: declare the queues, their quarantine queues and the queues'
           exchanges, the node's mailbox (<node>.celery.pidbox), celeryev,
           celery.pidbox, reply.celery.pidbox
write:     bind the queues and the mailbox; publish to amq.default
           (results, republished and quarantined copies), the queues'
           exchanges (retries), celeryev (events), reply.celery.pidbox
           (remote control replies), and --send-to
read:      consume the queues and the mailbox; bind from the queues'
           exchanges and celery.pidbox

A worker whose user lacks one of them stops at start, naming it
(docs/security.md).`,
		setup: func(a *app, fs *flagSet) func(context.Context, []string) error {
			var (
				b         brokerFlags
				queues    string
				hostname  string
				sendTo    string
				noControl bool
			)
			b.define(fs)
			fs.String(&queues, "queues", "LIST", "celery", "comma-separated queues the worker consumes, as the worker's --queues")
			fs.String(&hostname, "hostname", "NAME", control.DefaultNodeName, "the worker's node name pattern, as its --hostname: %h, %n and %d match any host, %p any process id")
			fs.String(&sendTo, "send-to", "LIST", "", "comma-separated exchanges the worker's tasks publish workflow steps to besides their own queues' (a chain's step routed to another application's queue: the exchange is the queue's name), given write permission")
			fs.Bool(&noControl, "no-control", "the worker runs with --no-control: no remote control nor events, so no mailbox, celeryev nor celery.pidbox")
			return func(_ context.Context, args []string) error {
				if len(args) > 0 {
					return usagef("permissions", "unexpected argument %q", args[0])
				}
				names := splitList(queues)
				if len(names) == 0 {
					return usagef("permissions", "--queues names no queue")
				}
				node, err := nodeRegexp(hostname)
				if err != nil {
					return usagef("permissions", "invalid --hostname %q: %v", hostname, err)
				}
				u, err := brokerURI(b.url)
				if err != nil {
					return usagef("permissions", "%s", oneLine(err))
				}
				p := brokerPermissions(names, splitList(sendTo), node, !noControl)
				fmt.Fprintf(a.stdout, "rabbitmqctl add_vhost %s\n", shellQuote(u.Vhost))
				fmt.Fprintf(a.stdout, "rabbitmqctl add_user %s 'PASSWORD'\n", shellQuote(u.Username))
				fmt.Fprintf(a.stdout, "rabbitmqctl set_permissions -p %s %s %s %s %s\n", shellQuote(u.Vhost), shellQuote(u.Username),
					shellQuote(p.configure), shellQuote(p.write), shellQuote(p.read))
				return nil
			}
		},
	}
}

// permissions are the three regular expressions of rabbitmqctl
// set_permissions.
type permissions struct{ configure, write, read string }

// brokerPermissions are the permissions of a worker consuming queues
// (names), publishing workflow steps to the exchanges sendTo besides, with
// the node name matched by node (a regular expression) and, with control,
// remote control and events. RabbitMQ matches a permission's expression
// against queue and exchange names alike, unanchored: each is anchored
// here. A queue's exchange is its name, as Celery declares it.
func brokerPermissions(queues, sendTo []string, node string, withControl bool) permissions {
	q := make([]string, len(queues))
	for i, name := range queues {
		q[i] = regexp.QuoteMeta(name)
	}
	work := "(" + strings.Join(q, "|") + ")"
	configure := []string{work + `(\.quarantine)?`}
	write := []string{work, regexp.QuoteMeta(amqp.DefaultExchange)}
	read := []string{work}
	for _, ex := range sendTo {
		write = append(write, regexp.QuoteMeta(ex))
	}
	if withControl {
		mailbox := node + regexp.QuoteMeta(".celery.pidbox")
		ev, pidbox, reply := regexp.QuoteMeta(control.EventExchange), regexp.QuoteMeta(control.PidboxExchange), regexp.QuoteMeta(control.ReplyExchange)
		configure = append(configure, mailbox, ev, pidbox, reply)
		write = append(write, mailbox, ev, reply)
		read = append(read, mailbox, pidbox)
	}
	anchor := func(alts []string) string { return "^(" + strings.Join(alts, "|") + ")$" }
	return permissions{configure: anchor(configure), write: anchor(write), read: anchor(read)}
}

// nodeRegexp is a regular expression matching the node names of the
// pattern (control.NodeName's substitutions, and "@%h" added to a name
// without '@'): any host for %h, %n and %d, any process id for %p and %i.
func nodeRegexp(pattern string) (string, error) {
	if pattern == "" {
		pattern = control.DefaultNodeName
	}
	if !strings.Contains(strings.ReplaceAll(pattern, "%%", ""), "@") {
		pattern += "@%h" // as control.NodeName: a name without a host gets this one's
	}
	var b strings.Builder
	for i := 0; i < len(pattern); i++ {
		c := pattern[i]
		if c != '%' || i+1 == len(pattern) {
			b.WriteString(regexp.QuoteMeta(string(c)))
			continue
		}
		i++
		switch pattern[i] {
		case 'h':
			b.WriteString(`.+`)
		case 'n':
			b.WriteString(`[^.]+`)
		case 'd':
			b.WriteString(`.*`)
		case 'p', 'i':
			b.WriteString(`[0-9]+`)
		case '%':
			b.WriteString("%")
		default:
			return "", fmt.Errorf("unknown substitution %%%c", pattern[i])
		}
	}
	return b.String(), nil
}

// brokerURI is the broker URL parsed (Celery's spellings accepted).
func brokerURI(raw string) (amqp091.URI, error) {
	s, err := amqp.DialURL(raw)
	if err != nil {
		return amqp091.URI{}, err
	}
	u, err := amqp091.ParseURI(s)
	if err != nil {
		return amqp091.URI{}, fmt.Errorf("broker URL %s: %s", amqp.RedactURL(raw), "cannot be parsed")
	}
	return u, nil
}

// splitList is a comma-separated list's items, trimmed, without empty
// ones and repeats.
func splitList(s string) []string {
	var out []string
	for _, item := range strings.Split(s, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		dup := false
		for _, o := range out {
			dup = dup || o == item
		}
		if !dup {
			out = append(out, item)
		}
	}
	return out
}

// shellQuote quotes s for a POSIX shell.
func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
