package cmd

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestDocsNameWhatExists keeps README.md and docs/*.md in step with the
// code: every Go identifier, test or benchmark name and repository path
// they name must exist. It reads the Go sources of the repository with
// go/parser (no type checking, under a second) and checks, in the docs:
//
//   - `pkg.Name` and `pkg.Type.Member`, where pkg is a package of this
//     repository (by its package name, e.g. tasks.Worker,
//     idempotency.Store.Claim, amqp.Config.URL; a lower-case Name such as
//     the task name demo.add is not Go and is left alone), in code spans and
//     in Go code blocks;
//   - `Type.Member` where Type is a type of this repository (Call.Reference);
//   - `TestX`, `BenchmarkX`, `FuzzX`, `ExampleX`, also in sh code blocks;
//   - paths such as tasks/pipeline.go, docs/limits.md, ./integration/bench,
//     bare Go and Markdown file names such as pipeline.go, and relative
//     Markdown links.
//
// CHANGELOG.md is history and may name what is gone: it is not read.
func TestDocsNameWhatExists(t *testing.T) {
	t.Parallel()
	const root = ".."
	idx, err := indexRepo(root)
	if err != nil {
		t.Fatal(err)
	}
	docs, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	docs = append([]string{filepath.Join(root, "README.md")}, docs...)
	checked := 0
	for _, doc := range docs {
		b, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		rel, _ := filepath.Rel(root, doc)
		for _, ref := range docRefs(string(b)) {
			checked++
			if why := idx.check(root, filepath.Dir(doc), ref); why != "" {
				t.Errorf("%s:%d: `%s`: %s", rel, ref.line, ref.text, why)
			}
		}
	}
	if checked < 100 {
		t.Fatalf("only %d references found in the docs: the extraction is broken", checked)
	}
}

// docRef is one reference found in a document.
type docRef struct {
	kind string // "code" (a code span), "go", "sh" (a code block line), "link"
	text string
	line int
}

var (
	codeSpan = regexp.MustCompile("`([^`\n]+)`")
	mdLink   = regexp.MustCompile(`\]\(([^)\s]+)\)`)
)

// docRefs returns the code spans, the lines of go and sh code blocks and the
// link targets of a Markdown text.
func docRefs(md string) []docRef {
	var refs []docRef
	fence := "" // the info string of the code block we are in
	inBlock := false
	for i, line := range strings.Split(md, "\n") {
		n := i + 1
		if trimmed := strings.TrimSpace(line); strings.HasPrefix(trimmed, "```") {
			if inBlock {
				inBlock, fence = false, ""
			} else {
				inBlock, fence = true, strings.TrimPrefix(trimmed, "```")
			}
			continue
		}
		if inBlock {
			if fence == "go" || fence == "sh" {
				refs = append(refs, docRef{kind: fence, text: line, line: n})
			}
			continue
		}
		for _, m := range codeSpan.FindAllStringSubmatch(line, -1) {
			refs = append(refs, docRef{kind: "code", text: m[1], line: n})
		}
		for _, m := range mdLink.FindAllStringSubmatch(line, -1) {
			refs = append(refs, docRef{kind: "link", text: m[1], line: n})
		}
	}
	return refs
}

var (
	qualified   = regexp.MustCompile(`^([a-z][a-z0-9]*)\.([A-Z]\w*)(?:\.(\w+))?$`)
	typeMember  = regexp.MustCompile(`^([A-Z]\w*)\.([A-Za-z_]\w*)$`)
	testName    = regexp.MustCompile(`^(Test|Benchmark|Fuzz|Example)[A-Z_]\w*$`)
	inGo        = regexp.MustCompile(`\b([a-z][a-z0-9]*)\.([A-Z]\w*)`)
	inSh        = regexp.MustCompile(`\b((?:Test|Benchmark|Fuzz|Example)[A-Z_]\w*)`)
	pathLike    = regexp.MustCompile(`^(\./)?[\w.+-]+(/[\w.*+-]+)*/?$`)
	fileExts    = []string{".go", ".md", ".py", ".sql", ".sh", ".json", ".conf"}
	cutAtSyntax = regexp.MustCompile(`[({\[]`)
)

// check returns why ref names something that does not exist, or "".
func (x *repoIndex) check(root, docDir string, ref docRef) string {
	switch ref.kind {
	case "link":
		target, _, _ := strings.Cut(ref.text, "#")
		if target == "" || strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
			return ""
		}
		if _, err := os.Stat(filepath.Join(docDir, target)); err != nil {
			return "link target does not exist"
		}
		return ""
	case "go":
		var whys []string
		for _, m := range inGo.FindAllStringSubmatch(ref.text, -1) {
			if why := x.checkQualified(m[1], m[2], ""); why != "" {
				whys = append(whys, m[1]+"."+m[2]+": "+why)
			}
		}
		return strings.Join(whys, "; ")
	case "sh":
		var whys []string
		for _, m := range inSh.FindAllStringSubmatch(ref.text, -1) {
			if !x.tests[m[1]] {
				whys = append(whys, m[1]+": no such test function")
			}
		}
		command := true // the program's own word: ./onceler is built by the reader
		for _, f := range strings.Fields(ref.text) {
			if strings.HasPrefix(f, "#") {
				break
			}
			if command && !strings.Contains(f, "=") {
				command = false
				continue
			}
			if strings.HasPrefix(f, "./") || strings.HasPrefix(f, ".ci/") || strings.HasPrefix(f, "scripts/") {
				if why := x.checkPath(root, docDir, strings.Trim(f, `'"`)); why != "" {
					whys = append(whys, f+": "+why)
				}
			}
		}
		return strings.Join(whys, "; ")
	}
	var whys []string
	words := strings.Fields(ref.text)
	for i, tok := range words {
		if i == 0 && len(words) > 1 && strings.HasPrefix(tok, "./") {
			continue // a command line: ./onceler is built by the reader
		}
		if why := x.checkToken(root, docDir, tok); why != "" {
			whys = append(whys, why)
		}
	}
	return strings.Join(whys, "; ")
}

// checkToken checks one word of a code span.
func (x *repoIndex) checkToken(root, docDir, tok string) string {
	tok = strings.TrimLeft(tok, "*&")
	tok = strings.TrimPrefix(tok, "[]")
	tok = strings.TrimRight(tok, ",;:")
	if strings.Contains(tok, "://") || strings.HasPrefix(tok, "-") || strings.HasPrefix(tok, "/") {
		return ""
	}
	if pathLike.MatchString(tok) && (strings.Contains(tok, "/") || hasExt(tok)) {
		return x.checkPath(root, docDir, tok)
	}
	ident := tok
	if loc := cutAtSyntax.FindStringIndex(ident); loc != nil {
		ident = ident[:loc[0]]
	}
	if m := qualified.FindStringSubmatch(ident); m != nil {
		if why := x.checkQualified(m[1], m[2], m[3]); why != "" {
			return ident + ": " + why
		}
		return ""
	}
	if m := typeMember.FindStringSubmatch(ident); m != nil {
		if why := x.checkTypeMember(m[1], m[2]); why != "" {
			return ident + ": " + why
		}
		return ""
	}
	if testName.MatchString(ident) && !x.tests[ident] {
		return ident + ": no such test function"
	}
	return ""
}

func hasExt(tok string) bool {
	for _, e := range fileExts {
		if strings.HasSuffix(tok, e) {
			return true
		}
	}
	return false
}

// checkPath checks a repository path, relative to the root or to the
// document; a bare file name must be the name of some file in the
// repository; a path that does not start with ./ and whose first element is not in the repository (a URL
// path, a MIME type) is not ours and is left alone.
func (x *repoIndex) checkPath(root, docDir, p string) string {
	dotted := strings.HasPrefix(p, "./") // ./integration/bench: certainly ours
	p = strings.TrimPrefix(p, "./")
	p = strings.TrimSuffix(p, "...") // a package pattern: ./integration/...
	if !strings.Contains(strings.TrimSuffix(p, "/"), "/") && hasExt(p) {
		if !strings.HasSuffix(p, ".go") && !strings.HasSuffix(p, ".md") {
			return "" // manage.py, celeryconfig.json: often someone else's
		}
		if x.files[p] {
			return ""
		}
		return "no file of that name in the repository"
	}
	first, _, _ := strings.Cut(p, "/")
	if _, err := os.Stat(filepath.Join(root, first)); err != nil && !dotted {
		return "" // not a path of this repository (celery/app/trace.py, application/json)
	}
	for _, base := range []string{root, docDir} {
		if m, _ := filepath.Glob(filepath.Join(base, p)); len(m) > 0 {
			return ""
		}
	}
	return "no such path"
}

func (x *repoIndex) checkQualified(pkg, name, member string) string {
	p := x.pkgs[pkg]
	if p == nil {
		return "" // not a package of this repository (pgx, zap, a Python module)
	}
	if !p.decls[name] {
		return "package " + pkg + " declares no " + name
	}
	if member == "" {
		return ""
	}
	if !x.hasMember(pkg, name, member, 0) {
		return fmt.Sprintf("%s.%s has no field or method %s", pkg, name, member)
	}
	return ""
}

func (x *repoIndex) checkTypeMember(typ, member string) string {
	found := false
	for pkg, p := range x.pkgs {
		if _, ok := p.types[typ]; !ok {
			continue
		}
		found = true
		if x.hasMember(pkg, typ, member, 0) {
			return ""
		}
	}
	if !found {
		return "" // not a type of this repository
	}
	return "no type " + typ + " of this repository has a field or method " + member
}

// hasMember reports whether pkg.typ has a field or method named member,
// also through embedded fields and aliases; a type that embeds (or is) a
// type from outside the repository may have any member.
func (x *repoIndex) hasMember(pkg, typ, member string, depth int) bool {
	p := x.pkgs[pkg]
	if p == nil || depth > 5 {
		return true
	}
	ti, ok := p.types[typ]
	if !ok {
		return false
	}
	if ti.members[member] {
		return true
	}
	for _, e := range ti.embeds {
		if x.pkgs[e.pkg] == nil || x.hasMember(e.pkg, e.name, member, depth+1) {
			return true
		}
	}
	return false
}

// repoIndex is what the repository's Go sources declare.
type repoIndex struct {
	pkgs  map[string]*pkgIndex // by package name; package main is left out
	tests map[string]bool      // Test, Benchmark, Fuzz and Example functions
	files map[string]bool      // base names of every file
}

type pkgIndex struct {
	decls map[string]bool // top-level names
	types map[string]*typeIndex
}

type typeIndex struct {
	members map[string]bool // fields and methods
	embeds  []typeRef       // embedded types and alias targets
}

type typeRef struct{ pkg, name string }

func indexRepo(root string) (*repoIndex, error) {
	x := &repoIndex{pkgs: map[string]*pkgIndex{}, tests: map[string]bool{}, files: map[string]bool{}}
	fset := token.NewFileSet()
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if path != root && strings.HasPrefix(d.Name(), ".") {
				return filepath.SkipDir
			}
			return nil
		}
		x.files[d.Name()] = true
		if !strings.HasSuffix(path, ".go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		name := strings.TrimSuffix(f.Name.Name, "_test")
		isTest := strings.HasSuffix(path, "_test.go")
		for _, decl := range f.Decls {
			if fd, ok := decl.(*ast.FuncDecl); ok && fd.Recv == nil && isTest && testName.MatchString(fd.Name.Name) {
				x.tests[fd.Name.Name] = true
			}
		}
		if name == "main" || isTest {
			return nil
		}
		p := x.pkgs[name]
		if p == nil {
			p = &pkgIndex{decls: map[string]bool{}, types: map[string]*typeIndex{}}
			x.pkgs[name] = p
		}
		p.add(name, f)
		return nil
	})
	return x, err
}

func (p *pkgIndex) typ(name string) *typeIndex {
	t := p.types[name]
	if t == nil {
		t = &typeIndex{members: map[string]bool{}}
		p.types[name] = t
	}
	return t
}

func (p *pkgIndex) add(pkg string, f *ast.File) {
	for _, decl := range f.Decls {
		switch d := decl.(type) {
		case *ast.FuncDecl:
			if d.Recv == nil {
				p.decls[d.Name.Name] = true
				continue
			}
			if r := typeOf(pkg, d.Recv.List[0].Type); r.name != "" {
				p.typ(r.name).members[d.Name.Name] = true
			}
		case *ast.GenDecl:
			for _, spec := range d.Specs {
				switch s := spec.(type) {
				case *ast.ValueSpec:
					for _, n := range s.Names {
						p.decls[n.Name] = true
					}
				case *ast.TypeSpec:
					p.decls[s.Name.Name] = true
					t := p.typ(s.Name.Name)
					switch tt := s.Type.(type) {
					case *ast.StructType:
						for _, fld := range tt.Fields.List {
							if len(fld.Names) == 0 {
								r := typeOf(pkg, fld.Type)
								t.embeds = append(t.embeds, r)
								t.members[r.name] = true
							}
							for _, n := range fld.Names {
								t.members[n.Name] = true
							}
						}
					case *ast.InterfaceType:
						for _, m := range tt.Methods.List {
							for _, n := range m.Names {
								t.members[n.Name] = true
							}
							if len(m.Names) == 0 {
								t.embeds = append(t.embeds, typeOf(pkg, m.Type))
							}
						}
					default:
						if s.Assign.IsValid() {
							t.embeds = append(t.embeds, typeOf(pkg, s.Type))
						}
					}
				}
			}
		}
	}
}

// typeOf names the type an expression denotes: package and type name,
// through pointers and type arguments. A type it cannot name (a func type,
// a map) gets the package "" so that hasMember accepts any member of it.
func typeOf(pkg string, e ast.Expr) typeRef {
	switch t := e.(type) {
	case *ast.StarExpr:
		return typeOf(pkg, t.X)
	case *ast.IndexExpr:
		return typeOf(pkg, t.X)
	case *ast.IndexListExpr:
		return typeOf(pkg, t.X)
	case *ast.Ident:
		return typeRef{pkg, t.Name}
	case *ast.SelectorExpr:
		if id, ok := t.X.(*ast.Ident); ok {
			return typeRef{id.Name, t.Sel.Name}
		}
	}
	return typeRef{}
}

// TestDocRefsCatchDrift shows that TestDocsNameWhatExists fails on what it
// is for: each line names something that does not exist, and each is
// reported; the last lines name what does, and are not.
func TestDocRefsCatchDrift(t *testing.T) {
	t.Parallel()
	idx, err := indexRepo("..")
	if err != nil {
		t.Fatal(err)
	}
	doc := "`tasks.NoSuchThing`\n" +
		"`idempotency.Store.NoSuchMethod`\n" +
		"`amqp.Config.NoSuchField`\n" +
		"`Call.NoSuchField`\n" +
		"`tasks/no_such_file.go`\n" +
		"`no_such_file.go`\n" +
		"`TestNoSuchTest`\n" +
		"[a link](no-such-page.md)\n" +
		"```go\nw, err := tasks.NoSuchWorker(reg)\n```\n" +
		"```sh\ngo test -run 'TestNoSuchTest' ./no_such_dir/\n```\n" +
		"`tasks.Worker`, `idempotency.Store.Claim`, `amqp.Delivery.Body`, `tasks.Task[A]`, `tasks.Policy`\n" +
		"`Call.Reference`, `tasks/pipeline.go`, `pipeline.go`, `TestReadmeWalkthrough`, `demo.add`, `pgx.Tx`\n" +
		"[limits](limits.md) `cmd.Main(cmd.App{...})` `application/json` `celery/app/trace.py`\n"
	var failed []int
	for _, ref := range docRefs(doc) {
		if why := idx.check("..", "../docs", ref); why != "" {
			failed = append(failed, ref.line)
			t.Logf("line %d: `%s`: %s", ref.line, ref.text, why)
		}
	}
	// Lines 1-8, the go line (10) and the sh line (13) are wrong; the rest
	// are right.
	want := []int{1, 2, 3, 4, 5, 6, 7, 8, 10, 13}
	if fmt.Sprint(failed) != fmt.Sprint(want) {
		t.Fatalf("lines reported %v, want %v", failed, want)
	}
}

// README says what onceler is, how to start and how to write a task, and
// links the rest: it stays short enough to read in one sitting.
func TestReadmeIsShort(t *testing.T) {
	t.Parallel()
	const limit = 12_000 // 12 KB
	fi, err := os.Stat("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	if fi.Size() > limit {
		t.Errorf("README.md is %d bytes, more than %d: move a subject to a page in docs/", fi.Size(), limit)
	}
}
