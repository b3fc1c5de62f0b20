package cmd

import (
	"fmt"
	"net"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/internal/testenv"
)

func TestHTTPListenAddr(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"9808":           "127.0.0.1:9808",
		":9808":          "127.0.0.1:9808",
		"0.0.0.0:9808":   "0.0.0.0:9808",
		"[::]:9808":      "[::]:9808",
		"10.1.2.3:9808":  "10.1.2.3:9808",
		"localhost:9808": "localhost:9808",
		":0":             "127.0.0.1:0",
	} {
		if got, err := httpListenAddr(in); err != nil || got != want {
			t.Errorf("httpListenAddr(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, bad := range []string{"nonsense", "host:", "host:port", "99999", ":99999"} {
		if got, err := httpListenAddr(bad); err == nil {
			t.Errorf("httpListenAddr(%q) = %q, want an error", bad, got)
		}
	}
}

// TestWorkerHTTPEndpointIsLoopbackAndBounded starts a worker with
// --http-addr :PORT: it listens on 127.0.0.1 only (not on the host's
// other addresses), serves /metrics, /healthz and /readyz and nothing else
// (no pprof), and its metrics' labels stay bounded after many messages
// with task names it does not know, random task ids, operation keys and
// arguments: none of those appears in /metrics.
func TestWorkerHTTPEndpointIsLoopbackAndBounded(t *testing.T) {
	t.Parallel()
	s := newStack(t)
	_, port, err := net.SplitHostPort(freeAddr(t))
	if err != nil {
		t.Fatal(err)
	}
	w := startWorker(t, s.env, "--http-addr", ":"+port)
	if !strings.Contains(w.stderr.String(), `"addr":"127.0.0.1:`+port+`"`) {
		t.Fatalf("no log of the listener on 127.0.0.1:%s:\n%s", port, w.stderr.String())
	}
	base := "http://127.0.0.1:" + port
	for path, want := range map[string]int{
		"/healthz": 200, "/metrics": 200, "/debug/pprof/": 404, "/debug/pprof/heap": 404,
		"/debug/vars": 404, "/": 404, "/other": 404, "/metrics/x": 404,
	} {
		if code, _ := httpGet(t, base+path); code != want {
			t.Errorf("GET %s: %d, want %d", path, code, want)
		}
	}
	// Not on the host's other addresses.
	addrs, _ := net.InterfaceAddrs()
	tried := 0
	for _, a := range addrs {
		ipn, ok := a.(*net.IPNet)
		if !ok || ipn.IP.IsLoopback() || ipn.IP.IsLinkLocalUnicast() {
			continue
		}
		tried++
		c, err := net.DialTimeout("tcp", net.JoinHostPort(ipn.IP.String(), port), 2*time.Second)
		if err == nil {
			_ = c.Close()
			t.Errorf("the endpoint answers on %s, not only on the loopback interface", ipn.IP)
		}
	}
	t.Logf("checked %d non-loopback addresses", tried)

	// Many unknown task names, ids, keys and arguments.
	var calls []call
	var secrets []string
	for i := range 40 {
		name := testenv.Name(fmt.Sprintf("evil.task%d", i))
		secret := testenv.Name("secretarg")
		secrets = append(secrets, name, secret)
		calls = append(calls, call{name, []any{secret}})
	}
	for range 10 {
		key, acct := testenv.Name("secretkey"), testenv.Name("secretacct")
		secrets = append(secrets, key, acct)
		calls = append(calls, call{demo.TaskCredit, []any{acct, key, 5}})
	}
	ids, replies := s.sendTasks(t, 60*time.Second, calls...).replies(120 * time.Second)
	if len(replies) != len(calls) {
		t.Fatalf("%d replies for %d calls", len(replies), len(calls))
	}
	secrets = append(secrets, ids...)
	_, metrics := httpGet(t, base+"/metrics")
	for _, sec := range secrets {
		if strings.Contains(metrics, sec) {
			t.Errorf("/metrics holds %q", sec)
		}
	}
	tasks := map[string]bool{}
	for _, m := range regexp.MustCompile(`task="([^"]*)"`).FindAllStringSubmatch(metrics, -1) {
		tasks[m[1]] = true
	}
	var names []string
	for n := range tasks {
		names = append(names, n)
	}
	slices.Sort(names)
	if strings.Join(names, ",") != demo.TaskCredit+",unregistered" {
		t.Errorf("task label values %v, want %s and unregistered", names, demo.TaskCredit)
	}
	series := 0
	for _, line := range strings.Split(metrics, "\n") {
		if strings.HasPrefix(line, "onceler_") {
			series++
		}
	}
	if series > 150 {
		t.Errorf("%d onceler_ series after %d calls", series, len(calls))
	}
	t.Logf("%d onceler_ series, task label values %v", series, names)
	w.stop()
}
