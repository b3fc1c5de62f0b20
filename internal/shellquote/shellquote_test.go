package shellquote

import (
	"os/exec"
	"strings"
	"testing"
)

func TestQuote(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"onceler_worker": "onceler_worker",
		"Team Role":      "'Team Role'",
		"it's":           `'it'\''s'`,
		"":               "''",
		"$HOME;rm":       "'$HOME;rm'",
	} {
		if got := Quote(in); got != want {
			t.Errorf("Quote(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestQuoteInShell: sh reads each quoted word back as the word.
func TestQuoteInShell(t *testing.T) {
	t.Parallel()
	sh, err := exec.LookPath("sh")
	if err != nil {
		t.Skip("no sh")
	}
	words := []string{"a b", "it's", `"x"`, "$HOME", "`id`", "\\n", "Ops Team r1", "tab\there", "ünï"}
	quoted := make([]string, len(words))
	for i, w := range words {
		quoted[i] = Quote(w)
	}
	out, err := exec.Command(sh, "-c", `for w in `+strings.Join(quoted, " ")+`; do printf '%s\n' "$w"; done`).Output()
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Split(strings.TrimSuffix(string(out), "\n"), "\n"); strings.Join(got, "|") != strings.Join(words, "|") {
		t.Fatalf("sh read %q, want %q", got, words)
	}
}
