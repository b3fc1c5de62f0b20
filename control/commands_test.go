package control

import (
	"context"
	"regexp"
	"testing"
	"time"

	"github.com/onceler/onceler/celeryproto"
)

func TestParseRate(t *testing.T) {
	for in, want := range map[string]float64{"": 0, "0": 0, "10": 10, "10/s": 10, "30/m": 0.5, "7200/h": 2, " 1.5/s ": 1.5} {
		if got, err := ParseRate(in); err != nil || got != want {
			t.Errorf("ParseRate(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"x/s", "1/d", "-1", "NaN"} {
		if _, err := ParseRate(in); err == nil {
			t.Errorf("ParseRate(%q) accepted", in)
		}
	}
	if got := rateErrorRepr("x/s"); got != `ValueError("could not convert string to float: 'x'")` {
		t.Errorf("rateErrorRepr = %s", got)
	}
	if got := rateErrorRepr("1/d"); got != `KeyError('d')` {
		t.Errorf("rateErrorRepr = %s", got)
	}
}

func TestHumanBytes(t *testing.T) {
	for in, want := range map[float64]string{100: "100b", 1024: "1KB", 1536: "1.5KB", 52.3456 * (1 << 20): "52.346MB", 3 << 30: "3GB"} {
		if got := humanBytes(in); got != want {
			t.Errorf("humanBytes(%v) = %s, want %s", in, got, want)
		}
	}
}

func TestBrokerInfo(t *testing.T) {
	info := BrokerInfo("amqps://user:secret@rabbit.example:5673/prod%2Fa;amqp://user:secret@b//", 10*time.Second, 4*time.Second)
	want := map[string]any{"hostname": "rabbit.example", "port": 5673, "userid": "user", "virtual_host": "prod/a", "ssl": true,
		"transport": "amqp", "heartbeat": 10.0, "connect_timeout": 4.0, "alternates": []any{"amqp://user:xxxxx@b//"}}
	for k, v := range want {
		if !jsonEqual(info[k], v) {
			t.Errorf("%s = %v, want %v", k, info[k], v)
		}
	}
	if s := mustJSONAny(info); regexp.MustCompile("secret|password").MatchString(s) {
		t.Errorf("BrokerInfo leaks the password: %s", s)
	}
}

// TestTuningWithoutTuner: a Worker that is no Tuner answers the tuning
// commands with an error; the debugging ones answer anyway.
func TestTuningWithoutTuner(t *testing.T) {
	c := newUnitController(t, Config{})
	call := func(method string, args map[string]any) any {
		res, _ := c.dispatch(context.Background(), &celeryproto.ControlRequest{Method: method, Arguments: args})
		return res
	}
	for method, want := range map[string]any{
		"rate_limit":      nok("rate_limit is not supported by this worker"),
		"time_limit":      nok("time_limit is not supported by this worker"),
		"add_consumer":    nok("add_consumer is not supported by this worker"),
		"cancel_consumer": nok("cancel_consumer is not supported by this worker"),
		"pool_grow":       nok("pool_grow is not supported by this worker"),
		"pool_shrink":     nok("pool_shrink is not supported by this worker"),
		"autoscale":       nok(`ValueError('Autoscale not enabled')`),
		"election":        nok(`unknown command "election"`),
	} {
		if got := call(method, map[string]any{"task_name": "demo.add", "rate_limit": "1/s", "queue": "q"}); !jsonEqual(got, want) {
			t.Errorf("%s = %v, want %v", method, got, want)
		}
	}
	if got := call("rate_limit", map[string]any{"task_name": "demo.add", "rate_limit": "1/d"}); !jsonEqual(got, nok("Invalid rate limit string: KeyError('d')")) {
		t.Errorf("rate_limit 1/d = %v", got)
	}
	if got, _ := call("memsample", nil).(string); !regexp.MustCompile(`^[0-9.]+(b|KB|MB|GB)$`).MatchString(got) {
		t.Errorf("memsample = %q", got)
	}
	if got, _ := call("memdump", nil).(string); !regexp.MustCompile(`^- rss \(sample\):\n-    > [0-9.]+(b|KB|MB|GB),\n- rss \(end\): [0-9.]+(b|KB|MB|GB)\.\n$`).MatchString(got) {
		t.Errorf("memdump = %q", got)
	}
	if got, _ := call("memdump", nil).(string); !regexp.MustCompile(`^- rss \(end\): [0-9.]+(b|KB|MB|GB)\.\n$`).MatchString(got) {
		t.Errorf("memdump without samples = %q", got)
	}
	if got := call("dump_conf", nil); !jsonEqual(got, call("conf", nil)) {
		t.Errorf("dump_conf = %v", got)
	}
}
