package cmd

import (
	"regexp"
	"strings"
	"testing"

	"github.com/onceler/onceler/control"
)

// printedSetPermissions is the three expressions of the set_permissions
// line 'onceler permissions' printed (single-quoted, without a quote
// inside).
func printedSetPermissions(t *testing.T, out string) [3]string {
	t.Helper()
	for _, l := range strings.Split(out, "\n") {
		if !strings.HasPrefix(l, "rabbitmqctl set_permissions ") {
			continue
		}
		f := strings.Split(l, "' '")
		if len(f) != 5 {
			t.Fatalf("set_permissions line %q", l)
		}
		return [3]string{f[2], f[3], strings.TrimSuffix(f[4], "'")}
	}
	t.Fatalf("no set_permissions line in:\n%s", out)
	return [3]string{}
}

// TestPermissionsNodeNameEndingInPercent: the worker takes --hostname
// 'w%' (control.NodeName keeps a last '%' as it is and adds "@<host>");
// 'onceler permissions' given the same --hostname must print expressions
// that cover that node's mailbox, not refuse the pattern.
func TestPermissionsNodeNameEndingInPercent(t *testing.T) {
	t.Parallel()
	node, err := control.NodeName("w%")
	if err != nil {
		t.Fatalf("the worker refuses --hostname 'w%%' too: %v", err)
	}
	env := map[string]string{"ONCELER_BROKER_URL": "amqp://w:secret@127.0.0.1:5672/v"}
	r := runIn(t, env, "permissions", "--queues", "q1", "--hostname", "w%")
	if r.err != nil {
		t.Fatalf("the worker runs as node %q with --hostname 'w%%', but onceler permissions --hostname 'w%%' fails: %v", node, r.err)
	}
	p := printedSetPermissions(t, r.stdout)
	mailbox := node + ".celery.pidbox"
	for i, what := range []string{"configure", "write", "read"} {
		if !regexp.MustCompile(p[i]).MatchString(mailbox) {
			t.Errorf("%s %s does not match the mailbox %q", what, p[i], mailbox)
		}
	}
}

// TestPermissionsTakesWorkersBrokerURLList: a worker's --broker-url (and
// ONCELER_BROKER_URL) may be a failover list; 'onceler permissions' is to
// be run "with the worker's flags or environment", so it must take the
// list too (the vhost and user are the same in each URL).
func TestPermissionsTakesWorkersBrokerURLList(t *testing.T) {
	t.Parallel()
	env := map[string]string{"ONCELER_BROKER_URL": "amqp://w:secret@rabbit-a:5672/v;amqp://w:secret@rabbit-b:5672/v"}
	r := runIn(t, env, "permissions", "--queues", "q1")
	if r.err != nil {
		t.Fatalf("onceler permissions with the worker's broker URL list: %v", r.err)
	}
	if !strings.Contains(r.stdout, "rabbitmqctl add_vhost 'v'\n") || !strings.Contains(r.stdout, "rabbitmqctl add_user 'w' 'PASSWORD'\n") {
		t.Fatalf("printed:\n%s", r.stdout)
	}
}

// TestPermissionsTakesWorkersQueueArg: a worker run with --queue-arg
// x-dead-letter-exchange=dlx declares its queue with it, for which
// RabbitMQ wants write on the exchange dlx (and read on the queue).
// 'onceler permissions', run with the worker's flags, must take the flag
// and give that write.
func TestPermissionsTakesWorkersQueueArg(t *testing.T) {
	t.Parallel()
	env := map[string]string{"ONCELER_BROKER_URL": "amqp://w:secret@127.0.0.1:5672/v"}
	r := runIn(t, env, "permissions", "--queues", "q1", "--queue-arg", "x-dead-letter-exchange=dlx")
	if r.err != nil {
		t.Fatalf("onceler permissions with the worker's --queue-arg: %v", r.err)
	}
	p := printedSetPermissions(t, r.stdout)
	if !regexp.MustCompile(p[1]).MatchString("dlx") {
		t.Fatalf("write %s does not match the dead-letter exchange dlx", p[1])
	}
}
