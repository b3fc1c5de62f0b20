package integration

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/onceler/onceler/integration/replay"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// The binaries the tests start, built once per test run by TestMain.
var (
	oncelerBin string // cmd/onceler
	ownBin     string // integration/testdata/replayworker: "your own binary"
	runID      = testkit.NewID()[:8]
)

func TestMain(m *testing.M) {
	os.Exit(testenv.Main(m, func(dir string) error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		defer cancel()
		var err error
		if oncelerBin, err = replay.Build(ctx, dir, "github.com/onceler/onceler/cmd/onceler"); err != nil {
			return err
		}
		ownBin, err = replay.Build(ctx, dir, "github.com/onceler/onceler/integration/testdata/replayworker")
		return err
	}))
}
