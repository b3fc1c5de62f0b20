package testenv

import (
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"
)

// Main runs a package's tests for its TestMain: build (nil: nothing) first
// puts the programs the tests start into a temporary directory, removed
// afterwards; then the tests run; when they pass, no goroutine may be left
// behind (goleak). It returns the exit code for os.Exit.
func Main(m *testing.M, build func(dir string) error) int {
	dir, err := os.MkdirTemp("", "onceler-test")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer func() { _ = os.RemoveAll(dir) }()
	if build != nil {
		if err := build(dir); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
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
