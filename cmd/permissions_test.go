package cmd

import (
	"regexp"
	"strings"
	"testing"
)

// TestBrokerPermissions checks the expressions 'onceler permissions'
// prints against the names a worker uses and names it must not reach.
func TestBrokerPermissions(t *testing.T) {
	t.Parallel()
	node, err := nodeRegexp("onceler-%p@%h")
	if err != nil {
		t.Fatal(err)
	}
	p := brokerPermissions([]string{"q1", "a.b"}, []string{"other"}, node, true)
	mailbox := "onceler-4242@host.example.com.celery.pidbox"
	for _, c := range []struct {
		name, expr string
		yes, no    []string
	}{
		{"configure", p.configure,
			[]string{"q1", "a.b", "q1.quarantine", "a.b.quarantine", mailbox, "celeryev", "celery.pidbox", "reply.celery.pidbox"},
			[]string{"q2", "axb", "q1x", "xq1", "q1.quarantine.x", "other", "amq.default", "w1@host.celery.pidbox", "onceler-x@h.celery.pidbox", ""}},
		{"write", p.write,
			[]string{"q1", "a.b", "amq.default", "other", mailbox, "celeryev", "reply.celery.pidbox"},
			[]string{"q1.quarantine", "celery.pidbox", "amq.direct", "q2", ""}},
		{"read", p.read,
			[]string{"q1", "a.b", mailbox, "celery.pidbox"},
			[]string{"q1.quarantine", "celeryev", "reply.celery.pidbox", "amq.default", "other", ""}},
	} {
		re := regexp.MustCompile(c.expr)
		for _, n := range c.yes {
			if !re.MatchString(n) {
				t.Errorf("%s %s does not match %q", c.name, c.expr, n)
			}
		}
		for _, n := range c.no {
			if re.MatchString(n) {
				t.Errorf("%s %s matches %q", c.name, c.expr, n)
			}
		}
	}
	p = brokerPermissions([]string{"q1"}, nil, node, false)
	if all := p.configure + p.write + p.read; strings.Contains(all, "pidbox") || strings.Contains(all, "celeryev") {
		t.Errorf("without control: %+v", p)
	}
	for pattern, want := range map[string]string{
		"w1":       `w1@.+`,
		"w1@%h":    `w1@.+`,
		"w-%n@%d":  `w-[^.]+@.*`,
		"a%%b@x.y": `a%b@x\.y`,
	} {
		if got, err := nodeRegexp(pattern); err != nil || got != want {
			t.Errorf("nodeRegexp(%q) = %q, %v; want %q", pattern, got, err, want)
		}
	}
	if _, err := nodeRegexp("w%x"); err == nil {
		t.Error("nodeRegexp accepts an unknown substitution")
	}
}
