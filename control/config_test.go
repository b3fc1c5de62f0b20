package control

import (
	"os"
	"strconv"
	"strings"
	"testing"
)

func TestNodeName(t *testing.T) {
	host, _ := os.Hostname()
	pid := strconv.Itoa(os.Getpid())
	for pattern, want := range map[string]string{
		"":               "onceler-" + pid + "@" + host,
		"w1":             "w1@" + host,
		"w1@box":         "w1@box",
		"w-%p@%h":        "w-" + pid + "@" + host,
		"w%%@%n":         "w%@" + strings.Split(host, ".")[0],
		"worker%i@x.%d!": "worker" + pid + "@x." + strings.Join(strings.Split(host, ".")[1:], ".") + "!",
	} {
		got, err := NodeName(pattern)
		if err != nil || got != want {
			t.Errorf("NodeName(%q) = %q, %v; want %q", pattern, got, err, want)
		}
	}
	for _, bad := range []string{"w%x", "@host"} {
		if _, err := NodeName(bad); err == nil {
			t.Errorf("NodeName(%q) accepted", bad)
		}
	}
}
