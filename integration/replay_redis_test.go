package integration

import (
	"net"
	"os"
	"testing"
	"time"

	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/internal/testenv"
)

// redisURL is the Redis result backend of the tests: database 9 of
// ONCELER_TEST_REDIS_ADDR, else 127.0.0.1:6379. The test skips when it does
// not answer, unless services are required.
func redisURL(t *testing.T) string {
	t.Helper()
	addr := os.Getenv("ONCELER_TEST_REDIS_ADDR")
	if addr == "" {
		addr = "127.0.0.1:6379"
	}
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		testenv.Unavailable(t, "Redis not available at %s: %v", addr, err)
	}
	_ = c.Close()
	return "redis://" + addr + "/9"
}

// TestReplayDemoRedis runs the replay suite on every demo task with the
// workers' results in Redis (--result-backend): every caller finds its
// result under its task id, with the same guarantees as TestReplayDemo.
func TestReplayDemoRedis(t *testing.T) {
	url := redisURL(t)
	for _, tg := range demoTargets() {
		t.Run(tg.Task, func(t *testing.T) {
			tg.ResultBackend = url
			replay.Run(t, tg)
		})
	}
}
