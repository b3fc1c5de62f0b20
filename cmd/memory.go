package cmd

import (
	"fmt"
	"math"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
)

// memoryMargin is what the worker's Go memory limit allows beyond the
// memory budget: the process's own heap (connections, pools, buffers,
// metrics).
const memoryMargin = 64 << 20

// parseSize reads a size in bytes: a number with an optional unit, KiB,
// MiB, GiB or TiB (powers of 1024; Ki, Mi, Gi, Ti too) or KB, MB, GB, TB
// (powers of 1000); a bare number is bytes.
func parseSize(s string) (int64, error) {
	s = strings.TrimSpace(s)
	i := strings.IndexFunc(s, func(r rune) bool { return (r < '0' || r > '9') && r != '.' })
	num, unit := s, ""
	if i >= 0 {
		num, unit = s[:i], strings.TrimSpace(s[i:])
	}
	units := map[string]float64{"": 1, "B": 1,
		"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
		"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
		"KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
	mul, ok := units[unit]
	if !ok {
		return 0, fmt.Errorf("unknown unit %q (use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)", unit)
	}
	v, err := strconv.ParseFloat(num, 64)
	if err != nil || num == "" {
		return 0, fmt.Errorf("not a size: %q", s)
	}
	n := v * mul
	if n <= 0 || n > math.MaxInt64/2 {
		return 0, fmt.Errorf("size %q out of range", s)
	}
	return int64(n), nil
}

// workerMemoryLimit sets the Go runtime's soft memory limit to the budget
// plus memoryMargin unless GOMEMLIMIT is set, so that the collector runs
// before the heap outgrows them (GOGC alone would let a 400% heap grow
// first), and returns the limit in effect (math.MaxInt64: none).
func workerMemoryLimit(budget int64) int64 {
	if _, ok := os.LookupEnv("GOMEMLIMIT"); ok {
		return debug.SetMemoryLimit(-1) // read it
	}
	limit := budget + memoryMargin
	debug.SetMemoryLimit(limit)
	return limit
}
