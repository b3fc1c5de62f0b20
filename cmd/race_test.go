//go:build race

package cmd

// raceEnabled says whether the tests run with -race: the binary they start
// is then built with -race too.
const raceEnabled = true
