package cmd

import (
	"flag"
	"os"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite docs/cli.md from the commands' help")

//go:generate go test -run TestCLIDocsUpToDate . -args -update

// cliDoc renders docs/cli.md: the main help and every command's --help, as
// the binary prints them.
func cliDoc(t *testing.T) string {
	t.Helper()
	var b strings.Builder
	b.WriteString("# onceler command line\n\n")
	b.WriteString("Generated from the commands' help by `go generate ./cmd`; a test fails when it is stale.\n\n")
	b.WriteString("Every flag has an environment variable, shown in its help: the variable sets\n")
	b.WriteString("the default, the flag wins. Mistakes in flags or environment print one line\n")
	b.WriteString("and exit with status 2; runtime failures (a service that does not answer, a\n")
	b.WriteString("record that is not held, ...) print one line and exit with status 1.\n\n")
	b.WriteString("```\n$ onceler help\n" + mainHelp() + "```\n")
	for _, c := range commands() {
		r := runIn(t, nil, c.name, "--help")
		if r.err != nil {
			t.Fatalf("%s --help: %v", c.name, r.err)
		}
		b.WriteString("\n## onceler " + c.name + "\n\n```\n$ onceler " + c.name + " --help\n" + r.stdout + "```\n")
	}
	return b.String()
}

func TestCLIDocsUpToDate(t *testing.T) {
	t.Parallel()
	const path = "../docs/cli.md"
	want := cliDoc(t)
	if *update {
		if err := os.WriteFile(path, []byte(want), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("read %s: %v (run: go generate ./cmd)", path, err)
	}
	if string(got) != want {
		t.Fatalf("%s is stale: run go generate ./cmd", path)
	}
}

func TestHelpListsEveryFlagWithItsEnvironmentVariable(t *testing.T) {
	t.Parallel()
	for _, c := range commands() {
		fs := newFlagSet(c)
		c.setup(&app{getenv: func(string) string { return "" }}, fs)
		help := fs.help()
		for _, name := range fs.order {
			if fs.noEnv[name] {
				continue // "command line only": TestDestructiveSwitchesIgnoreTheEnvironment
			}
			if !strings.Contains(help, "--"+name) || !strings.Contains(help, envName(name)) {
				t.Errorf("%s --help misses --%s or %s:\n%s", c.name, name, envName(name), help)
			}
		}
	}
}
