package cmd

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"runtime/debug"
	"sort"
	"strconv"
	"strings"
	"time"
)

// usageError is a mistake in the command line or the environment: the
// process exits with status 2 and names the command's --help.
type usageError struct {
	cmd  string
	msg  string
	prog string // the program's name; set by App.Run, "onceler" until then
}

func (e *usageError) Error() string {
	prog := e.prog
	if prog == "" {
		prog = "onceler"
	}
	if e.cmd == "" {
		return e.msg + " (run '" + prog + " help')"
	}
	return e.cmd + ": " + e.msg + " (run '" + prog + " " + e.cmd + " --help')"
}

func usagef(cmd, format string, args ...any) error {
	return &usageError{cmd: cmd, msg: fmt.Sprintf(format, args...)}
}

// app holds what a command needs from the process, so tests can run commands
// in-process with their own environment and output.
type app struct {
	stdout, stderr io.Writer
	getenv         func(string) string
	prog           string // the program's name, for help and messages
	user           App    // the binary's tasks and tables
}

// command is one subcommand: its flags are defined by setup, which returns the
// function that runs it with the positional arguments.
type command struct {
	name    string
	args    string // positional arguments, for the usage line
	summary string // one line, for "onceler help"
	long    string // paragraphs shown by --help
	setup   func(a *app, fs *flagSet) func(ctx context.Context, args []string) error
}

// commands lists the subcommands in the order "onceler help" shows them.
func commands() []*command {
	return []*command{
		workerCommand(),
		migrateCommand(),
		recordsCommand(),
		resolveCommand(),
		repeatsCommand(),
		purgeCommand(),
		quarantineCommand(),
		permissionsCommand(),
	}
}

func (a *app) run(ctx context.Context, args []string) error {
	if len(args) == 0 {
		return usagef("", "no command given")
	}
	name := args[0]
	switch name {
	case "help", "-h", "-help", "--help":
		if len(args) > 1 && name == "help" {
			if c := lookupCommand(args[1]); c != nil {
				return a.runCommand(ctx, c, []string{"--help"})
			}
			return usagef("", "unknown command %q", args[1])
		}
		a.mainUsage(a.stdout)
		return nil
	case "version", "-version", "--version":
		if len(args) > 1 {
			return usagef("", "version takes no arguments")
		}
		fmt.Fprintln(a.stdout, a.named(versionLine()))
		return nil
	}
	c := lookupCommand(name)
	if c == nil {
		return usagef("", "unknown command %q", name)
	}
	return a.runCommand(ctx, c, args[1:])
}

// versionLine is the module version and the VCS revision the binary was
// built from, as its build info records them.
func versionLine() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "onceler (no build info)"
	}
	return formatVersion(bi)
}

func formatVersion(bi *debug.BuildInfo) string {
	line := "onceler " + bi.Main.Version
	settings := map[string]string{}
	for _, s := range bi.Settings {
		settings[s.Key] = s.Value
	}
	if rev := settings["vcs.revision"]; rev != "" {
		line += " revision " + rev
		if settings["vcs.modified"] == "true" {
			line += " (modified)"
		}
		if t := settings["vcs.time"]; t != "" {
			line += " " + t
		}
	} else {
		line += " (no VCS revision recorded)"
	}
	return line + " " + bi.GoVersion
}

func lookupCommand(name string) *command {
	for _, c := range commands() {
		if c.name == name {
			return c
		}
	}
	return nil
}

func (a *app) mainUsage(w io.Writer) {
	fmt.Fprint(w, a.named(mainHelp()))
}

func mainHelp() string {
	var b strings.Builder
	b.WriteString("onceler runs Celery tasks written in Go from RabbitMQ, beside Python Celery\n")
	b.WriteString("producers, and keeps a durable record in PostgreSQL so each effect happens once.\n\n")
	b.WriteString("Usage: onceler COMMAND [flags] [args]\n\nCommands:\n")
	for _, c := range commands() {
		fmt.Fprintf(&b, "  %-11s %s\n", c.name, c.summary)
	}
	fmt.Fprintf(&b, "  %-11s %s\n", "version", "print the module version and VCS revision (also --version)")
	b.WriteString("\nRun 'onceler COMMAND --help' for the flags of a command. Every flag can be\n")
	b.WriteString("set with an environment variable ONCELER_<FLAG> (upper case, '-' as '_');\n")
	b.WriteString("a flag on the command line wins over the environment.\n")
	return b.String()
}

func (a *app) runCommand(ctx context.Context, c *command, args []string) error {
	fs := newFlagSet(c)
	runFn := c.setup(a, fs)
	if err := fs.applyEnv(a.getenv); err != nil {
		return err
	}
	pos, err := fs.parse(args)
	if errors.Is(err, flag.ErrHelp) {
		fmt.Fprint(a.stdout, a.named(fs.help()))
		return nil
	}
	if err != nil {
		return err
	}
	if err := fs.readSecrets(); err != nil {
		return err
	}
	return runFn(ctx, pos)
}

// flagSet is a flag.FlagSet whose flags also read ONCELER_* variables and
// whose help names them.
type flagSet struct {
	fs    *flag.FlagSet
	cmd   *command
	metas map[string]string // flag name -> value placeholder in help
	order []string
	// noEnv: flags read from the command line only (switches that decide
	// what is destroyed must never come from a forgotten export).
	noEnv map[string]bool
	// alias: flag name -> the flag it is another name of.
	alias map[string]string
	// secrets: flag name -> the path its -file flag gave (see Secret).
	secrets map[string]*string
	// skipSecrets, when set and true after parsing, leaves the -file flags
	// unread (a command line that connects to nothing).
	skipSecrets func() bool
}

func newFlagSet(c *command) *flagSet {
	fs := flag.NewFlagSet(c.name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	return &flagSet{fs: fs, cmd: c, metas: map[string]string{}, noEnv: map[string]bool{}, alias: map[string]string{}, secrets: map[string]*string{}}
}

// envName is the environment variable of a flag: ONCELER_ and the flag name
// in upper case with '-' as '_'.
func envName(flagName string) string {
	return "ONCELER_" + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

func (f *flagSet) add(name, meta string) {
	f.metas[name] = meta
	f.order = append(f.order, name)
}

func (f *flagSet) String(p *string, name, meta, def, usage string) {
	f.fs.StringVar(p, name, def, usage)
	f.add(name, meta)
}

func (f *flagSet) Int(p *int, name string, def int, usage string) {
	f.fs.IntVar(p, name, def, usage)
	f.add(name, "N")
}

func (f *flagSet) Bool(p *bool, name string, usage string) {
	f.fs.BoolVar(p, name, false, usage)
	f.add(name, "")
}

func (f *flagSet) Duration(p *time.Duration, name string, def time.Duration, usage string) {
	*p = def
	f.fs.Var((*durationValue)(p), name, usage)
	f.add(name, "DURATION")
}

// Secret defines a string flag whose value may carry a password, and
// beside it the flag name-file (variable ONCELER_<NAME>_FILE, the Docker and
// Kubernetes convention for secrets mounted as files): the value is read
// from that file, so it need not sit on the command line nor in the
// environment. readSecrets reads it after parsing.
func (f *flagSet) Secret(p *string, name, meta, def, usage string) {
	f.String(p, name, meta, def, usage)
	path := new(string)
	f.String(path, name+"-file", "PATH", "", "read --"+name+" from this file: its one line, without the blanks around it (a secret mounted as a file keeps the password out of the command line and the environment); not with --"+name)
	f.secrets[name] = path
}

// readSecrets sets each Secret flag whose -file flag was given from its
// file: its one line, without the blanks around it. Both given, or a file
// that cannot be read, is empty (or blank) or holds more than one line, is
// a usage error naming the path, never the content. It reads nothing when
// the command's skipSecrets says so.
func (f *flagSet) readSecrets() error {
	if f.skipSecrets != nil && f.skipSecrets() {
		return nil
	}
	set := map[string]bool{}
	f.fs.Visit(func(fl *flag.Flag) { set[fl.Name] = true })
	names := make([]string, 0, len(f.secrets))
	for name := range f.secrets {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		path := *f.secrets[name]
		if path == "" {
			continue
		}
		if set[name] {
			return usagef(f.cmd.name, "give --%s (%s) or --%s-file (%s), not both", name, envName(name), name, envName(name+"-file"))
		}
		b, err := os.ReadFile(path)
		if err != nil {
			var pe *fs.PathError
			if errors.As(err, &pe) {
				err = pe.Err
			}
			return usagef(f.cmd.name, "cannot read --%s-file %s: %v", name, path, err)
		}
		v := strings.TrimSpace(string(b))
		if v == "" {
			return usagef(f.cmd.name, "--%s-file %s is empty", name, path)
		}
		if strings.ContainsAny(v, "\r\n") {
			return usagef(f.cmd.name, "--%s-file %s holds more than one line: it must hold the value alone, on one line", name, path)
		}
		if err := f.fs.Set(name, v); err != nil {
			return usagef(f.cmd.name, "invalid value in --%s-file %s", name, path)
		}
	}
	return nil
}

// List defines a repeatable flag whose values may also be comma-separated.
// The command line replaces what the flag's environment variable gave.
func (f *flagSet) List(p *[]string, name, meta, usage string) {
	f.fs.Var(&listValue{p: p}, name, usage)
	f.add(name, meta)
}

// listValue is the value of a List flag.
type listValue struct {
	p *[]string
	// fromEnv: the values came from the environment; the command line
	// replaces them.
	fromEnv bool
}

func (l *listValue) String() string {
	if l.p == nil {
		return ""
	}
	return strings.Join(*l.p, ",")
}

func (l *listValue) Set(s string) error {
	if l.fromEnv {
		*l.p, l.fromEnv = nil, false
	}
	for _, v := range strings.Split(s, ",") {
		if v = strings.TrimSpace(v); v != "" {
			*l.p = append(*l.p, v)
		}
	}
	return nil
}

// CommandLineOnly marks a flag as read from the command line only, never
// from its environment variable.
func (f *flagSet) CommandLineOnly(name string) { f.noEnv[name] = true }

// Alias defines name as another name of the flag target, listed in help
// under target.
func (f *flagSet) Alias(name, target string) {
	fl := f.fs.Lookup(target)
	f.fs.Var(fl.Value, name, "same as --"+target)
	f.alias[name] = target
}

// durationValue is a time.Duration flag whose error says what a duration
// looks like.
type durationValue time.Duration

func (d *durationValue) String() string { return (*time.Duration)(d).String() }

func (d *durationValue) Set(s string) error {
	v, err := time.ParseDuration(s)
	if err != nil {
		if _, nerr := strconv.ParseFloat(s, 64); nerr == nil {
			return fmt.Errorf("a duration needs a unit: %ss, %sm or %sh (ns, us, ms, s, m, h)", s, s, s)
		}
		return errors.New("not a duration: use a number and a unit, such as 5s, 2m or 1h30m")
	}
	*d = durationValue(v)
	return nil
}

// applyEnv sets each flag from its environment variable, when set, before the
// command line is parsed, so the command line wins.
func (f *flagSet) applyEnv(getenv func(string) string) error {
	for _, name := range f.allNames() {
		env := envName(name)
		v := getenv(env)
		if v == "" || f.noEnv[f.target(name)] {
			continue
		}
		if err := f.fs.Set(name, v); err != nil {
			return usagef(f.cmd.name, "invalid %s=%q: %v", env, v, cleanFlagErr(err))
		}
		if lv, ok := f.fs.Lookup(name).Value.(*listValue); ok {
			lv.fromEnv = true
		}
	}
	return nil
}

// allNames is every flag name, aliases first: a flag's own variable wins
// over its alias's.
func (f *flagSet) allNames() []string {
	var names []string
	for a := range f.alias {
		names = append(names, a)
	}
	sort.Strings(names)
	return append(names, f.order...)
}

// target is the flag that name stands for.
func (f *flagSet) target(name string) string {
	if t, ok := f.alias[name]; ok {
		return t
	}
	return name
}

// aliasOf is the alias of the flag name, or "".
func (f *flagSet) aliasOf(name string) string {
	for a, t := range f.alias {
		if t == name {
			return a
		}
	}
	return ""
}

// ignoredEnv reports whether the environment sets the variable of a
// command-line only flag (for an error that says why it was not taken).
func (f *flagSet) ignoredEnv(getenv func(string) string, name string) (string, bool) {
	env := envName(name)
	return env, f.noEnv[name] && getenv(env) != ""
}

// parse reads flags anywhere among the positional arguments (so that
// "resolve TASK KEY --completed" works); "--" ends the flags.
func (f *flagSet) parse(args []string) ([]string, error) {
	var pos []string
	for {
		if err := f.fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, err
			}
			return nil, usagef(f.cmd.name, "%s", f.suggest(cleanFlagErr(err)))
		}
		rest := f.fs.Args()
		if len(rest) == 0 {
			return pos, nil
		}
		if len(args) > len(rest) && args[len(args)-len(rest)-1] == "--" {
			return append(pos, rest...), nil
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
}

// suggest adds to an unknown-flag message the nearest known flag, when one
// is near enough to be a typo.
func (f *flagSet) suggest(msg string) string {
	name, ok := strings.CutPrefix(msg, "unknown flag --")
	if !ok {
		return msg
	}
	best, dist := "", 0
	f.fs.VisitAll(func(fl *flag.Flag) {
		d := editDistance(name, fl.Name)
		if best == "" || d < dist || (d == dist && fl.Name < best) {
			best, dist = fl.Name, d
		}
	})
	if best != "" && (dist <= max(2, len(name)/3) || strings.HasPrefix(best, name) || strings.HasPrefix(name, best)) {
		return msg + "; did you mean --" + best + "?"
	}
	return msg
}

// editDistance is the Levenshtein distance between a and b.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

func cleanFlagErr(err error) string {
	s := err.Error()
	s = strings.Replace(s, "flag provided but not defined: -", "unknown flag --", 1)
	s = strings.Replace(s, " for flag -", " for --", 1)
	if name, ok := strings.CutPrefix(s, "flag needs an argument: -"); ok {
		s = "--" + name + " needs a value"
	}
	return s
}

// help renders the command's --help text.
func (f *flagSet) help() string {
	c := f.cmd
	var b strings.Builder
	fmt.Fprintf(&b, "Usage: onceler %s [flags]", c.name)
	if c.args != "" {
		b.WriteString(" " + c.args)
	}
	b.WriteString("\n\n" + strings.TrimSpace(c.long) + "\n\nFlags:\n")
	names := append([]string(nil), f.order...)
	sort.Strings(names)
	for _, name := range names {
		fl := f.fs.Lookup(name)
		head := "  --" + name
		if m := f.metas[name]; m != "" {
			head += " " + m
		}
		b.WriteString(head + "\n")
		for _, line := range wrap(fl.Usage, 70) {
			b.WriteString("        " + line + "\n")
		}
		meta := "env " + envName(name)
		if f.noEnv[name] {
			meta = "command line only"
		}
		if a := f.aliasOf(name); a != "" {
			meta = "alias --" + a + "; " + meta
			if !f.noEnv[name] {
				meta += " or " + envName(a)
			}
		}
		if fl.DefValue != "" && fl.DefValue != "false" && fl.DefValue != "0" && fl.DefValue != "0s" {
			meta += ", default " + fl.DefValue
		}
		b.WriteString("        (" + meta + ")\n")
	}
	b.WriteString("  --help\n        show this help\n")
	return b.String()
}

func wrap(s string, width int) []string {
	var lines []string
	var cur string
	for _, w := range strings.Fields(s) {
		if cur != "" && len(cur)+1+len(w) > width {
			lines = append(lines, cur)
			cur = w
			continue
		}
		if cur != "" {
			cur += " "
		}
		cur += w
	}
	if cur != "" {
		lines = append(lines, cur)
	}
	return lines
}
