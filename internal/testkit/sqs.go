package testkit

import (
	"net"
	"net/url"
	"os"
	"testing"
	"time"
)

// DefaultSQSEndpoint is the local SQS server (goaws, started by
// .ci/setup) tried when ONCELER_TEST_SQS_ENDPOINT is not set.
const DefaultSQSEndpoint = "http://127.0.0.1:4100"

// SQSEndpoint returns the SQS server of the tests, ONCELER_TEST_SQS_ENDPOINT,
// else DefaultSQSEndpoint, when it answers; otherwise it skips tb (fails
// it when services are required).
func SQSEndpoint(tb testing.TB) string {
	tb.Helper()
	ep := os.Getenv("ONCELER_TEST_SQS_ENDPOINT")
	if ep == "" {
		ep = DefaultSQSEndpoint
	}
	u, err := url.Parse(ep)
	if err != nil {
		tb.Fatalf("ONCELER_TEST_SQS_ENDPOINT %q: %v", ep, err)
	}
	c, err := net.DialTimeout("tcp", u.Host, 2*time.Second)
	if err != nil {
		Unavailable(tb, "SQS server not available at %s (.ci/setup starts goaws there): %v", ep, err)
	}
	_ = c.Close()
	return ep
}

// SQSEnv is the environment a process (worker, producer) needs to reach
// the test SQS server: the AWS SDK's region and static credentials (a
// local server checks no signature).
func SQSEnv() []string {
	return []string{"AWS_REGION=us-east-1", "AWS_DEFAULT_REGION=us-east-1", "AWS_ACCESS_KEY_ID=onceler-test",
		"AWS_SECRET_ACCESS_KEY=onceler-test", "AWS_EC2_METADATA_DISABLED=true"}
}
