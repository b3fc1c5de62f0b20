package testkit

import (
	"os/exec"
	"sync"
	"testing"
)

// RubySidekiq is the Ruby that runs Sidekiq 6 and ActiveJob in the tests.
const RubySidekiq = "/usr/bin/ruby"

var (
	rubyOnce sync.Once
	rubyErr  error
	rubyOut  []byte
)

// RequireRubySidekiq skips tb (fails it when services are required) unless
// RubySidekiq can load the sidekiq and active_job gems.
func RequireRubySidekiq(tb testing.TB) {
	tb.Helper()
	rubyOnce.Do(func() {
		rubyOut, rubyErr = exec.Command(RubySidekiq, "-e", `require "sidekiq"; require "sidekiq/api"; require "active_job"; require "globalid"`).CombinedOutput()
	})
	if rubyErr != nil {
		Unavailable(tb, "Ruby with sidekiq and active_job not available (%s): %v: %s", RubySidekiq, rubyErr, rubyOut)
	}
}
