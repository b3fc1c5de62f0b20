package integration

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/internal/testkit"
)

// The binaries the tests start, built once per test run by TestMain.
var (
	oncelerBin string // cmd/onceler
	ownBin     string // integration/testdata/replayworker: "your own binary"
	runID      = testkit.NewID()[:8]
)

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	dir, err := os.MkdirTemp("", "onceler-integration")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	if oncelerBin, err = replay.Build(ctx, dir, "github.com/onceler/onceler/cmd/onceler"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if ownBin, err = replay.Build(ctx, dir, "github.com/onceler/onceler/integration/testdata/replayworker"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	code := m.Run()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
			return 1
		}
	}
	return code
}
