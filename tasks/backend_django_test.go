package tasks

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/testenv"
	"github.com/onceler/onceler/internal/testkit"
)

// djangoApp is a throwaway Django project whose django-celery-results
// tables live in a schema of the test database, created by Django's own
// migrations.
type djangoApp struct {
	t       *testing.T
	schema  string
	pool    *pgxpool.Pool
	env     []string // PYTHONPATH and DJANGO_SETTINGS_MODULE
	backend string   // the worker's django-db+postgresql:// URL
}

// newDjangoApp writes the project's settings (INSTALLED_APPS =
// ['django_celery_results'], PostgreSQL with search_path set to a fresh
// schema) and runs `python3 -m django migrate` on it. migrate: false leaves
// the schema without the tables.
func newDjangoApp(t *testing.T, migrate bool) *djangoApp {
	t.Helper()
	testenv.Python(t)
	if _, err := os.Stat("/usr/lib/python3/dist-packages/django_celery_results/__init__.py"); err != nil {
		testenv.Unavailable(t, "python3-django-celery-results not installed")
	}
	raw := testenv.DatabaseURL(t)
	pool := testenv.Pool(t)
	a := &djangoApp{t: t, schema: testenv.Schema(t, pool), pool: pool}
	pc, err := pgconn.ParseConfig(raw)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	settings := fmt.Sprintf(`SECRET_KEY = "onceler-test"
USE_TZ = True
INSTALLED_APPS = ["django_celery_results"]
DATABASES = {"default": {"ENGINE": "django.db.backends.postgresql", "NAME": %q, "USER": %q,
    "PASSWORD": %q, "HOST": %q, "PORT": %d, "OPTIONS": {"options": "-c search_path=%s"}}}
CELERY_RESULT_BACKEND = "django-db"
`, pc.Database, pc.User, pc.Password, pc.Host, pc.Port, a.schema)
	if err := os.WriteFile(filepath.Join(dir, "onceler_django_settings.py"), []byte(settings), 0o600); err != nil {
		t.Fatal(err)
	}
	a.env = append(os.Environ(), "PYTHONPATH="+dir, "DJANGO_SETTINGS_MODULE=onceler_django_settings")
	if migrate {
		a.migrate()
	}
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("search_path", a.schema)
	u.RawQuery = q.Encode()
	a.backend = "django-db+" + u.String()
	return a
}

// openBackend opens the worker's backend on the app's tables, closed when
// the test ends.
func (a *djangoApp) openBackend() *djangoBackend {
	a.t.Helper()
	b, err := newDjangoBackend(a.backend, &Config{})
	if err != nil {
		a.t.Fatal(err)
	}
	a.t.Cleanup(func() { _ = b.close() })
	return b
}

// migrate creates the django-celery-results tables with Django's own
// migrations.
func (a *djangoApp) migrate() { a.migrateTo() }

// migrateTo runs manage.py migrate django_celery_results up to the
// migration named by target (all of them when none).
func (a *djangoApp) migrateTo(target ...string) {
	a.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	args := append([]string{"-m", "django", "migrate", "--settings=onceler_django_settings", "django_celery_results"}, target...)
	cmd := exec.CommandContext(ctx, testenv.Python(a.t), args...)
	cmd.Env = a.env
	if out, err := cmd.CombinedOutput(); err != nil {
		a.t.Fatalf("django migrate: %v\n%s", err, out)
	}
}

// python runs django_client.py with args under the project's settings.
func (a *djangoApp) python(args ...string) []byte {
	a.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, testenv.Python(a.t), append([]string{filepath.Join("testdata", "django_client.py")}, args...)...)
	cmd.Env = a.env
	out, err := cmd.Output()
	if err != nil {
		var stderr string
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			stderr = string(ee.Stderr)
		}
		a.t.Fatalf("django_client.py: %v\n%s", err, stderr)
	}
	return out
}

// calls sends calls with real Celery whose result backend is "django-db".
func (a *djangoApp) calls(e *env, calls ...pyCall) []pyResult {
	a.t.Helper()
	spec, _ := json.Marshal(map[string]any{"protocol": 2, "serializer": "json", "backend": "django-db",
		"broker": e.url, "queue": e.queue, "timeout": 30, "calls": calls})
	out := a.python(string(spec))
	var res struct{ Results []pyResult }
	if err := json.Unmarshal(out, &res); err != nil || len(res.Results) != len(calls) {
		a.t.Fatalf("django_client.py output %q: %v", out, err)
	}
	return res.Results
}

// djangoRow is a django_celery_results_taskresult row; NULL is "<nil>".
type djangoRow struct {
	Status, ContentType, ContentEncoding, Result, Meta, Traceback string
	TaskName, TaskArgs, TaskKwargs, Worker, PeriodicTaskName      string
	DateDone, DateCreated                                         time.Time
}

func (a *djangoApp) row(taskID string) djangoRow {
	a.t.Helper()
	var r djangoRow
	var res, meta, tb, name, args, kwargs, worker, periodic *string
	err := a.pool.QueryRow(context.Background(), `SELECT status, content_type, content_encoding, result, meta, traceback,
		task_name, task_args, task_kwargs, worker, periodic_task_name, date_done, date_created
		FROM `+pgx.Identifier{a.schema, DjangoTaskTable}.Sanitize()+` WHERE task_id = $1`, taskID).Scan(
		&r.Status, &r.ContentType, &r.ContentEncoding, &res, &meta, &tb, &name, &args, &kwargs, &worker, &periodic,
		&r.DateDone, &r.DateCreated)
	if err != nil {
		a.t.Fatalf("row of %s: %v", taskID, err)
	}
	str := func(p *string) string {
		if p == nil {
			return "<nil>"
		}
		return *p
	}
	r.Result, r.Meta, r.Traceback, r.TaskName = str(res), str(meta), str(tb), str(name)
	r.TaskArgs, r.TaskKwargs, r.Worker, r.PeriodicTaskName = str(args), str(kwargs), str(worker), str(periodic)
	return r
}

// TestDjangoBackendCelery: with --result-backend django-db+postgresql://,
// real Celery callers configured with CELERY_RESULT_BACKEND = "django-db"
// get their results from a onceler worker: delay().get(), a failure raised
// as the task's exception type, and a group; the rows are
// django-celery-results' (with result_extended: task name, argsrepr,
// kwargsrepr, worker, traceback).
func TestDjangoBackendCelery(t *testing.T) {
	t.Parallel()
	a := newDjangoApp(t, true)
	e := newEnv(t)
	cfg := e.config()
	cfg.ResultBackend = a.backend
	cfg.ResultExtended = true
	e.start(djangoRegistry(t), cfg)

	members := make([]pyCall, 10)
	for i := range members {
		members[i] = pyCall{Task: "t.add", Args: []any{i, 100}}
	}
	start := time.Now()
	res := a.calls(e,
		pyCall{Task: "t.add", Args: []any{2, 3}},
		pyCall{Task: "t.fail", Args: []any{0, "acc-7"}},
		pyCall{Task: "t.add", Args: []any{1, 1}, Kwargs: map[string]any{}},
		pyCall{Group: members},
	)
	if string(res[0].OK) != "5" {
		t.Errorf("delay().get(): %+v", res[0])
	}
	if r := res[1]; r.ExcType != "KeyError" || r.ExcModule != "builtins" || r.Message != "no such account: acc-7" {
		t.Errorf("failure: %+v, want KeyError", r)
	}
	if string(res[3].OK) != "[100, 101, 102, 103, 104, 105, 106, 107, 108, 109]" {
		t.Errorf("group: %s", res[3].OK)
	}

	r := a.row(res[0].ID)
	if r.Status != "SUCCESS" || r.ContentType != "application/json" || r.ContentEncoding != "utf-8" ||
		r.Result != "5" || r.Meta != `{"children": []}` || r.Traceback != "<nil>" {
		t.Errorf("SUCCESS row: %+v", r)
	}
	if r.TaskName != "t.add" || r.TaskArgs != `"(2, 3)"` || r.TaskKwargs != `"{}"` || r.Worker != cfg.Hostname ||
		r.PeriodicTaskName != "<nil>" {
		t.Errorf("extended columns: %+v", r)
	}
	if r.DateDone.Before(start.Add(-time.Second)) || r.DateDone.After(time.Now()) || r.DateCreated.After(r.DateDone) {
		t.Errorf("dates: created %s done %s (test started %s)", r.DateCreated, r.DateDone, start)
	}
	r = a.row(res[1].ID)
	if r.Status != "FAILURE" || r.Result != `{"exc_type": "KeyError", "exc_message": ["no such account: acc-7"], "exc_module": "builtins"}` ||
		!strings.Contains(r.Traceback, "KeyError") || r.TaskArgs != `"(0, 'acc-7')"` {
		t.Errorf("FAILURE row: %+v", r)
	}
}

func djangoRegistry(t *testing.T) *Registry {
	t.Helper()
	reg := NewRegistry()
	for _, err := range []error{
		Register(reg, Task[addArgs]{Name: "t.add", Run: func(_ context.Context, _ *Call, a addArgs) (any, error) {
			return a.X + a.Y, nil
		}}),
		Register(reg, Task[flakyArgs]{Name: "t.fail", Run: func(_ context.Context, _ *Call, a flakyArgs) (any, error) {
			return nil, KeyError("no such account: " + a.Op)
		}}),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	return reg
}

// TestDjangoBackendRows: the rows the backend writes for a SUCCESS and a
// FAILURE (without result_extended) are those django-celery-results'
// own DatabaseBackend writes for the same results (content type, encoding,
// result and meta text, NULL traceback and request columns); a SUCCESS is
// never replaced, anything else is.
func TestDjangoBackendRows(t *testing.T) {
	t.Parallel()
	a := newDjangoApp(t, true)
	b := a.openBackend()
	ctx := context.Background()
	if err := b.ping(ctx); err != nil {
		t.Fatalf("ping: %v", err)
	}
	value := map[string]any{"total": int64(12), "note": "café \"ok\"", "items": []any{1.5, nil, true}}
	put := func(r *celeryproto.Result) {
		t.Helper()
		r.Serializer = "json"
		_, meta, err := celeryproto.EncodeMeta(r, nil, time.Now())
		if err != nil {
			t.Fatal(err)
		}
		if err := b.put(ctx, r.TaskID, meta); err != nil {
			t.Fatalf("put %s: %v", r.Status, err)
		}
	}
	goOK, goFail, pyOK, pyFail := testenv.Name("ok"), testenv.Name("fail"), testenv.Name("pyok"), testenv.Name("pyfail")
	put(&celeryproto.Result{TaskID: goOK, Status: celeryproto.StateSuccess, Value: value})
	put(&celeryproto.Result{TaskID: goFail, Status: celeryproto.StateFailure, Traceback: "Traceback (most recent call last):\n",
		Exception: &celeryproto.Exception{Type: "KeyError", Module: "builtins", Message: "no such"}})
	stored, _ := json.Marshal([][]any{{pyOK, "SUCCESS", value}, {pyFail, "FAILURE", []string{"KeyError", "no such"}}})
	a.python("store", string(stored))

	for _, p := range [][2]string{{goOK, pyOK}, {goFail, pyFail}} {
		g, py := a.row(p[0]), a.row(p[1])
		g.DateDone, g.DateCreated, py.DateDone, py.DateCreated = time.Time{}, time.Time{}, time.Time{}, time.Time{}
		if g != py {
			t.Errorf("row differs from django-celery-results':\n onceler %+v\n python  %+v", g, py)
		}
	}

	// A late FAILURE does not replace the SUCCESS; a SUCCESS replaces a
	// STARTED.
	put(&celeryproto.Result{TaskID: goOK, Status: celeryproto.StateFailure,
		Exception: &celeryproto.Exception{Type: "ValueError", Module: "builtins", Message: "late"}})
	if r := a.row(goOK); r.Status != "SUCCESS" || !strings.Contains(r.Result, "café") && !strings.Contains(r.Result, `caf\u00e9`) {
		t.Errorf("SUCCESS replaced: %+v", r)
	}
	started := testenv.Name("started")
	put(&celeryproto.Result{TaskID: started, Status: celeryproto.StateStarted, Value: map[string]any{"pid": int64(1)}})
	put(&celeryproto.Result{TaskID: started, Status: celeryproto.StateSuccess, Value: "done"})
	if r := a.row(started); r.Status != "SUCCESS" || r.Result != `"done"` {
		t.Errorf("STARTED then SUCCESS: %+v", r)
	}
}

// TestDjangoBackendMissingTable: without the Django application's
// migrations the backend's check at start is one line that names the table
// and what to do, never the password; onceler creates nothing.
func TestDjangoBackendMissingTable(t *testing.T) {
	t.Parallel()
	a := newDjangoApp(t, false)
	u, err := url.Parse(strings.TrimPrefix(a.backend, "django-db+"))
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword(u.User.Username(), "s3cret-pw")
	for _, scheme := range []string{"django-db+postgresql", "django-db+postgres"} {
		u.Scheme = strings.TrimPrefix(scheme, "django-db+")
		raw := "django-db+" + u.String()
		if err := CheckResultBackend(raw); err != nil {
			t.Fatalf("%s refused: %v", scheme, err)
		}
		be, err := newBackend(&Config{ResultBackend: raw})
		if err != nil {
			t.Fatal(err)
		}
		err = be.ping(context.Background())
		_ = be.close()
		if err == nil || !strings.Contains(err.Error(), "table django_celery_results_taskresult does not exist") ||
			!strings.Contains(err.Error(), "migrate django_celery_results") || strings.Contains(err.Error(), "s3cret") ||
			strings.Contains(err.Error(), "\n") {
			t.Errorf("%s ping: %v", scheme, err)
		}
		if s := be.String(); strings.Contains(s, "s3cret") || !strings.HasPrefix(s, scheme+"://") {
			t.Errorf("String() %q", s)
		}
	}
	var n int
	if err := a.pool.QueryRow(context.Background(), "SELECT count(*) FROM pg_tables WHERE schemaname = $1", a.schema).Scan(&n); err != nil || n != 0 {
		t.Errorf("tables in the schema: %d (%v), want none", n, err)
	}
	if err := CheckResultBackend("django-db+postgresql://app:pw@db/app"); err != nil {
		t.Errorf("valid URL refused: %v", err)
	}
	if _, err := newBackend(&Config{ResultBackend: "django-db+postgresql://app:pw@db/app", ResultSerializer: "msgpack"}); err == nil ||
		!errors.Is(err, ErrBackendURL) {
		t.Errorf("msgpack with django-db: %v", err)
	}
}

// TestDjangoBackendHeldUntilMigrated: while the Django tables are missing
// the result is not lost nor the message acknowledged: the worker retries,
// and once the application migrates, the row appears and the message is
// settled.
func TestDjangoBackendHeldUntilMigrated(t *testing.T) {
	t.Parallel()
	heldUntilMigrated(t, newDjangoApp(t, false), "the table is missing")
}

// TestDjangoBackendHeldWhileMigrating: a result written while the Django
// application is between django_celery_results' migrations 0006 and 0007
// meets the first migration's NOT NULL column hidden, which the backend
// does not write (0007 drops it). The delivery is held, not answered with
// a refused result, and the result lands once the migrations are done.
func TestDjangoBackendHeldWhileMigrating(t *testing.T) {
	t.Parallel()
	a := newDjangoApp(t, false)
	a.migrateTo("0006")
	heldUntilMigrated(t, a, "the table has hidden")
}

// heldUntilMigrated runs a task whose result goes to a's tables, not yet
// migrated as the backend needs them (as says how), checks that its
// delivery stays unacknowledged while the writes fail, then migrates and
// checks that the result lands and the delivery is settled.
func heldUntilMigrated(t *testing.T, a *djangoApp, as string) {
	t.Helper()
	e := newEnv(t)
	cfg := e.config()
	cfg.ResultBackend = a.backend
	e.start(djangoRegistry(t), cfg)
	id := testenv.Name("held")
	e.publish(&celeryproto.Message{Protocol: 2, Task: "t.add", ID: id, Args: []any{int64(20), int64(22)}})
	time.Sleep(1500 * time.Millisecond) // several write attempts fail meanwhile
	if n := unacked(t, e.queue); n != 1 {
		t.Errorf("unacknowledged while %s: %d, want the held delivery", as, n)
	}
	a.migrate()
	var status, result string
	testkit.WaitFor(t, "the row after migrate", 30*time.Second, func() bool {
		err := a.pool.QueryRow(context.Background(), "SELECT status, result FROM "+
			pgx.Identifier{a.schema, DjangoTaskTable}.Sanitize()+" WHERE task_id = $1", id).Scan(&status, &result)
		return err == nil
	})
	if status != "SUCCESS" || result != "42" {
		t.Errorf("row: %s %s", status, result)
	}
	testkit.WaitFor(t, "the delivery settled", 10*time.Second, func() bool { return unacked(t, e.queue) == 0 })
	if n := e.queueDepth(e.queue); n != 0 {
		t.Errorf("queue depth %d after the result landed", n)
	}
}

// unacked is the number of unacknowledged messages of queue, from
// rabbitmqctl.
func unacked(t *testing.T, queue string) int {
	t.Helper()
	out, err := exec.Command("rabbitmqctl", "list_queues", "-q", "--no-table-headers", "name", "messages_unacknowledged").Output()
	if err != nil {
		testenv.Unavailable(t, "rabbitmqctl: %v", err)
	}
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) == 2 && f[0] == queue {
			var n int
			if _, err := fmt.Sscan(f[1], &n); err != nil {
				t.Fatalf("rabbitmqctl line %q", line)
			}
			return n
		}
	}
	t.Fatalf("queue %s not listed by rabbitmqctl", queue)
	return 0
}

// TestDjangoBackendChords: chords sent by real Celery 5.2.6 callers whose
// result backend is django-db (their apply_chord makes the
// django_celery_results_chordcounter row), the header parts run by a
// onceler worker: the part that ends the header publishes the Go body
// t.xsum with the results in header order, and chord.get() has its sum; a
// failed part gives the body's result ChordError and its errback is called
// with the body's task id; no chord counter row is left.
func TestDjangoBackendChords(t *testing.T) {
	t.Parallel()
	a := newDjangoApp(t, true)
	e := newEnv(t)
	e.backend = "django-db"
	rec := &callRecorder{}
	cfg := e.config()
	cfg.ResultBackend = a.backend
	e.start(chordRegistry(t, rec, &gate{}), cfg)

	ctx, cancel := context.WithTimeout(context.Background(), 180*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, testenv.Python(t), filepath.Join("testdata", "wf.py"), "chord_go_body", "chord_fail")
	cmd.Env = append(a.env, e.wfEnv(testenv.Name("pyq"))...)
	out, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			t.Fatalf("wf.py: %v\n%s", err, ee.Stderr)
		}
		t.Fatalf("wf.py: %v", err)
	}
	var res map[string]pyResult
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("wf.py output %q: %v", out, err)
	}
	if got := string(res["chord_go_body"].OK); got != "30" {
		t.Errorf("chord_go_body: got %s (%+v), want 30", got, res["chord_go_body"])
	}
	var failed struct {
		ID          string
		HeaderError string `json:"header_exc_type"`
		ExcType     string `json:"exc_type"`
		ExcModule   string `json:"exc_module"`
		Message     string
	}
	if err := json.Unmarshal(res["chord_fail"].OK, &failed); err != nil {
		t.Fatalf("chord_fail: %+v: %v", res["chord_fail"], err)
	}
	// AsyncResult.get() raises the failed part's ValueError when the part
	// failed before get() looked at the chord's parents, else the body's
	// ChordError once the body fails: Celery's client races there.
	if (failed.HeaderError != "ValueError" && failed.HeaderError != "ChordError") || failed.ExcType != "ChordError" || failed.ExcModule != "celery.exceptions" ||
		!strings.HasPrefix(failed.Message, "Dependency ") || !strings.HasSuffix(failed.Message, ` raised ValueError('part boom')`) {
		t.Errorf("chord_fail: %+v, want celery.exceptions.ChordError Dependency <id> raised ValueError('part boom')", failed)
	}
	testkit.WaitFor(t, "the chord body's errback", 10*time.Second, func() bool { return len(rec.byTag("chord-errback")) > 0 })
	if got := rec.byTag("chord-errback"); len(got) != 1 || got[0].Value != failed.ID {
		t.Errorf("chord errback calls %+v, want one with the body's id %s", got, failed.ID)
	}
	if r := a.row(failed.ID); r.Status != "FAILURE" || !strings.Contains(r.Result, `"exc_type": "ChordError"`) {
		t.Errorf("chord body row: %+v", r)
	}
	var left int
	if err := a.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+pgx.Identifier{a.schema, DjangoChordTable}.Sanitize()).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != 0 {
		t.Errorf("%d chord counter rows left", left)
	}
}

// TestDjangoBackendPrivileges: the backend's check at start names, in one
// line, what the URL's role lacks to store results (INSERT and UPDATE on
// the taskresult table, USAGE on its id sequence; SELECT, UPDATE and
// DELETE on the chord counters), and passes once they are granted, also
// as column grants (and UPDATE instead of USAGE on the sequence); the
// backend then stores results as that role.
func TestDjangoBackendPrivileges(t *testing.T) {
	t.Parallel()
	a := newDjangoApp(t, true)
	ctx := context.Background()
	role, roleURL := testenv.Role(t, a.pool)
	r := pgx.Identifier{role}.Sanitize()
	s := pgx.Identifier{a.schema}.Sanitize()
	testenv.Grant(t, a.pool, "GRANT USAGE ON SCHEMA "+s+" TO "+r)
	testenv.Grant(t, a.pool, "GRANT SELECT ON "+s+"."+DjangoTaskTable+" TO "+r)
	u, err := url.Parse(roleURL)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("search_path", a.schema)
	u.RawQuery = q.Encode()
	b, err := newDjangoBackend("django-db+"+u.String(), &Config{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.close() })
	err = b.ping(ctx)
	for _, want := range []string{"INSERT on " + DjangoTaskTable, "UPDATE on " + DjangoTaskTable, "USAGE on " + DjangoTaskTable + "_id_seq",
		"SELECT on " + DjangoChordTable, "UPDATE on " + DjangoChordTable, "DELETE on " + DjangoChordTable, fmt.Sprintf("role %q", role)} {
		if err == nil || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("ping as a role that may only read: %v, want one line naming %q", err, want)
		}
	}
	// Column grants of every column, and UPDATE on the sequence.
	for _, table := range []string{DjangoTaskTable, DjangoChordTable} {
		var cols string
		if err := a.pool.QueryRow(ctx, `SELECT string_agg(quote_ident(column_name), ', ') FROM information_schema.columns WHERE table_schema = $1 AND table_name = $2`,
			a.schema, table).Scan(&cols); err != nil {
			t.Fatal(err)
		}
		testenv.Grant(t, a.pool, "GRANT SELECT ("+cols+"), INSERT ("+cols+"), UPDATE ("+cols+") ON "+s+"."+table+" TO "+r)
	}
	testenv.Grant(t, a.pool, "GRANT DELETE ON "+s+"."+DjangoChordTable+" TO "+r)
	testenv.Grant(t, a.pool, "GRANT UPDATE ON SEQUENCE "+s+"."+DjangoTaskTable+"_id_seq TO "+r)
	if err := b.ping(ctx); err != nil {
		t.Fatalf("ping after the grants: %v", err)
	}
	r1 := &celeryproto.Result{TaskID: testenv.Name("priv"), Status: celeryproto.StateSuccess, Value: "ok", Serializer: "json"}
	_, meta, err := celeryproto.EncodeMeta(r1, nil, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if err := b.put(ctx, r1.TaskID, meta); err != nil {
		t.Fatalf("put as the role whose check passed: %v", err)
	}
}
