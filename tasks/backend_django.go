package tasks

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/clip"
	"github.com/onceler/onceler/internal/redact"
)

// DjangoTaskTable is the table of django-celery-results' TaskResult model,
// where a django-db+postgresql:// backend writes results. The Django
// application's migrations create it; the worker never does.
const DjangoTaskTable = "django_celery_results_taskresult"

// djangoStore is django-celery-results 2.4's DatabaseBackend._store_result
// and TaskResultManager.store_result in one statement: one row per task id,
// date_created when the row is made, date_done (auto_now) at every write.
// As Celery's key-value backends, a SUCCESS already stored is never
// replaced (a late duplicate or a lost worker's outcome cannot overwrite
// it). periodic_task_name is left alone: only Celery beat sets it.
const djangoStore = `INSERT INTO ` + DjangoTaskTable + ` AS t
  (task_id, status, content_type, content_encoding, result, date_done, traceback, meta,
   task_args, task_kwargs, task_name, worker, date_created)
VALUES ($1, $2, 'application/json', 'utf-8', $3, now(), $4, $5, $6, $7, $8, $9, now())
ON CONFLICT (task_id) DO UPDATE SET
  status = EXCLUDED.status, content_type = EXCLUDED.content_type,
  content_encoding = EXCLUDED.content_encoding, result = EXCLUDED.result,
  date_done = EXCLUDED.date_done, traceback = EXCLUDED.traceback, meta = EXCLUDED.meta,
  task_args = EXCLUDED.task_args, task_kwargs = EXCLUDED.task_kwargs,
  task_name = EXCLUDED.task_name, worker = EXCLUDED.worker
WHERE t.status <> 'SUCCESS'`

// djangoColumns are the columns the backend writes; ping checks that they
// are there.
const djangoColumns = "task_id, status, content_type, content_encoding, result, date_done, traceback, meta, " +
	"task_args, task_kwargs, task_name, worker, date_created"

type djangoBackend struct {
	pool *pgxpool.Pool
	url  string // redacted
}

// newDjangoBackend opens a pool of its own on the PostgreSQL database of
// raw, django-db+postgresql://... or django-db+postgres://... (the URL
// after "django-db+" is a libpq URL: its query may set search_path,
// sslmode and the other connection parameters). Results are written as
// JSON, as the only serializer whose text django-celery-results stores
// as is.
func newDjangoBackend(raw string, cfg *Config) (*djangoBackend, error) {
	if s := cfg.ResultSerializer; s != "" && s != "json" {
		return nil, backendURLError("the django-db backend takes JSON results; result serializer %q is not supported with it", s)
	}
	_, rest, _ := strings.Cut(raw, "+")
	red := redactURL(raw)
	pc, err := pgxpool.ParseConfig(rest)
	if err != nil {
		// pgx masks the password only up to its first '@'.
		return nil, backendURLError("PostgreSQL URL %s cannot be read: %s", red, redact.Text(err.Error(), rest))
	}
	pc.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(context.Background(), pc)
	if err != nil {
		return nil, fmt.Errorf("tasks: django-db backend %s: %s", red, redact.Text(err.Error(), rest))
	}
	return &djangoBackend{pool: pool, url: red}, nil
}

// djangoMeta is what the row takes of the task meta (EncodeMeta, JSON).
type djangoMeta struct {
	Status    string          `json:"status"`
	Result    json.RawMessage `json:"result"`
	Traceback *string         `json:"traceback"`
	Children  json.RawMessage `json:"children"`
	// Set with result_extended only.
	Name   *string         `json:"name"`
	Args   json.RawMessage `json:"args"`
	Kwargs json.RawMessage `json:"kwargs"`
	Worker *string         `json:"worker"`
}

var errDjangoMeta = errors.New("django-db backend: task meta is not JSON")

// errDjangoChord: a chord counter row whose sub_tasks cannot be read; it
// reads the same every time.
var errDjangoChord = errors.New("django-db backend: chord counter cannot be read")

func (b *djangoBackend) put(ctx context.Context, taskID string, meta []byte) error {
	var m djangoMeta
	if err := json.Unmarshal(meta, &m); err != nil {
		return fmt.Errorf("%w: %w", errDjangoMeta, err)
	}
	result, err := djangoResult(m.Result)
	if err != nil {
		return fmt.Errorf("%w: result: %w", errDjangoMeta, err)
	}
	children := m.Children
	if len(children) == 0 || string(children) == "null" {
		children = json.RawMessage("[]")
	}
	metaText, err := pythonJSON(json.RawMessage(`{"children":` + string(children) + `}`))
	if err != nil {
		return fmt.Errorf("%w: children: %w", errDjangoMeta, err)
	}
	// As django-celery-results 2.4: the task's name, arguments, worker and
	// traceback are stored with result_extended only (its
	// _get_extended_properties replaces them with NULL otherwise).
	var traceback, name, worker, args, kwargs *string
	if m.Name != nil || m.Worker != nil || m.Args != nil {
		traceback, name, worker = m.Traceback, m.Name, m.Worker
		if args, err = reprText(m.Args, true); err != nil {
			return fmt.Errorf("%w: args: %w", errDjangoMeta, err)
		}
		if kwargs, err = reprText(m.Kwargs, false); err != nil {
			return fmt.Errorf("%w: kwargs: %w", errDjangoMeta, err)
		}
	}
	_, err = b.pool.Exec(ctx, djangoStore, taskID, m.Status, result, traceback, metaText, args, kwargs, name, worker)
	if err != nil {
		return fmt.Errorf("django-db store of task %s: %w", clip.String(taskID, maxLogField), err)
	}
	return nil
}

// permanent: a meta that is not JSON, or a value PostgreSQL refuses
// (data exceptions, class 22: a task id longer than the column; integrity,
// class 23). A table that is not yet the one the backend writes is not
// permanent: migrating lets the held results through. So are a missing
// table or column, a refused permission, and a NOT NULL column the backend
// does not write (23502: the values it writes are never NULL where 2.4's
// table requires one): django_celery_results' first migration makes the
// table with such a column, hidden, which its seventh drops, so a write
// between the two, while the Django application migrates, meets it.
func (b *djangoBackend) permanent(err error) bool {
	if errors.Is(err, errDjangoMeta) || errors.Is(err, errDjangoChord) {
		return true
	}
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code == "23502" {
		return false
	}
	return strings.HasPrefix(pe.Code, "22") || strings.HasPrefix(pe.Code, "23")
}

// djangoPrivilegeSQL names the privileges the session's role lacks to
// write results ($1, the taskresult table: INSERT, UPDATE, and USAGE or
// UPDATE on the sequence of its serial id, as nextval takes either) and
// chord counters ($2, when that table exists: SELECT, UPDATE, DELETE).
// Column grants serve SELECT, INSERT and UPDATE (has_any_column_privilege:
// true for a table grant too). The tables are found on the URL's
// search_path, as the backend's statements find them.
const djangoPrivilegeSQL = `
WITH o AS (SELECT to_regclass($1) AS t, to_regclass($2) AS c)
SELECT current_user::text, ARRAY(
  SELECT x.what FROM (
    SELECT v.i, v.p || ' on ' || v.rel::text AS what
    FROM o, LATERAL (VALUES (1, o.t, 'INSERT'), (2, o.t, 'UPDATE'),
        (4, o.c, 'SELECT'), (5, o.c, 'UPDATE'), (6, o.c, 'DELETE')) AS v(i, rel, p)
    WHERE v.rel IS NOT NULL AND NOT CASE v.p WHEN 'DELETE' THEN has_table_privilege(v.rel, v.p)
        ELSE has_any_column_privilege(v.rel, v.p) END
    UNION ALL
    SELECT 3, 'USAGE on ' || s.oid::regclass::text
    FROM o JOIN pg_catalog.pg_depend d ON d.refobjid = o.t
    JOIN pg_catalog.pg_class s ON s.oid = d.objid
    WHERE d.classid = 'pg_catalog.pg_class'::regclass AND d.refclassid = 'pg_catalog.pg_class'::regclass
      AND d.deptype = 'a'
      AND CASE WHEN s.relkind = 'S' -- CASE: not evaluated for the table's other dependents
          THEN NOT (has_sequence_privilege(s.oid, 'USAGE') OR has_sequence_privilege(s.oid, 'UPDATE')) END
  ) x ORDER BY x.i, x.what)`

// ping checks that the database answers and holds the table with the
// columns the backend writes, and that the URL's role may write results
// (and chord counters), in one line that says what to do when not.
func (b *djangoBackend) ping(ctx context.Context) error {
	_, err := b.pool.Exec(ctx, "SELECT "+djangoColumns+" FROM "+DjangoTaskTable+" LIMIT 0")
	if err == nil {
		var role string
		var lacks []string
		if err = b.pool.QueryRow(ctx, djangoPrivilegeSQL, DjangoTaskTable, DjangoChordTable).Scan(&role, &lacks); err == nil && len(lacks) > 0 {
			return fmt.Errorf("PostgreSQL role %q of %s lacks %s, which storing results needs: grant them to it as the tables' owner (docs/security.md)",
				role, b.url, strings.Join(lacks, ", "))
		}
	}
	var pe *pgconn.PgError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &pe) && pe.Code == "42P01":
		return fmt.Errorf("table %s does not exist in %s: the Django application creates it (manage.py migrate django_celery_results); onceler never does", DjangoTaskTable, b.url)
	case errors.As(err, &pe) && pe.Code == "42703":
		return fmt.Errorf("table %s in %s lacks a column of django-celery-results 2.4 (%s): migrate django_celery_results", DjangoTaskTable, b.url, pe.Message)
	default:
		return fmt.Errorf("django-db backend %s: %w", b.url, err)
	}
}

func (b *djangoBackend) close() error {
	b.pool.Close()
	return nil
}

func (b *djangoBackend) String() string { return b.url }

// djangoResult is the result column: the result as JSON text; an
// exception in Celery's key order (exc_type, exc_message, exc_module), as
// Python's dict keeps it.
func djangoResult(raw json.RawMessage) (string, error) {
	var exc map[string]json.RawMessage
	if json.Unmarshal(raw, &exc) == nil && len(exc) == 3 && exc["exc_type"] != nil && exc["exc_message"] != nil && exc["exc_module"] != nil {
		parts := make([]string, 0, 3)
		for _, k := range []string{"exc_type", "exc_message", "exc_module"} {
			v, err := pythonJSON(exc[k])
			if err != nil {
				return "", err
			}
			parts = append(parts, `"`+k+`": `+v)
		}
		return "{" + strings.Join(parts, ", ") + "}", nil
	}
	return pythonJSON(raw)
}

// reprText is task_args or task_kwargs as django-celery-results stores
// them: the request's argsrepr/kwargsrepr (the Python repr of the
// arguments: a tuple, a dict, cut at 1024 characters as Celery's saferepr)
// encoded as a JSON string. nil when the meta has no arguments.
func reprText(raw json.RawMessage, tuple bool) (*string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	v, err := celeryproto.DecodeJSON(raw)
	if err != nil {
		return nil, err
	}
	var r string
	if args, ok := v.([]any); ok && tuple {
		r = celeryproto.ArgsRepr(args)
	} else {
		r = celeryproto.Repr(v)
	}
	var out strings.Builder
	pyJSONString(&out, r)
	s := out.String()
	return &s, nil
}

// pythonJSON rewrites the JSON value raw as Python's json.dumps writes it
// (kombu's json serializer, which django-celery-results stores): ", " and
// ": " separators, non-ASCII characters as \uXXXX escapes. Object keys stay
// in their order.
func pythonJSON(raw json.RawMessage) (string, error) {
	if len(raw) == 0 {
		return "null", nil
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var out strings.Builder
	if err := pyValue(dec, &out); err != nil {
		return "", err
	}
	if _, err := dec.Token(); err == nil {
		return "", errors.New("trailing data after the JSON value")
	}
	return out.String(), nil
}

func pyValue(dec *json.Decoder, out *strings.Builder) error {
	tok, err := dec.Token()
	if err != nil {
		return err
	}
	switch v := tok.(type) {
	case json.Delim:
		closing := json.Delim(']')
		if v == '{' {
			closing = '}'
		}
		out.WriteRune(rune(v))
		for i := 0; dec.More(); i++ {
			if i > 0 {
				out.WriteString(", ")
			}
			if v == '{' {
				k, err := dec.Token()
				if err != nil {
					return err
				}
				ks, _ := k.(string)
				pyJSONString(out, ks)
				out.WriteString(": ")
			}
			if err := pyValue(dec, out); err != nil {
				return err
			}
		}
		if _, err := dec.Token(); err != nil { // the closing delimiter
			return err
		}
		out.WriteRune(rune(closing))
	case string:
		pyJSONString(out, v)
	case json.Number:
		out.WriteString(v.String())
	case bool:
		out.WriteString(strconv.FormatBool(v))
	case nil:
		out.WriteString("null")
	}
	return nil
}

// pyJSONString writes s as Python's json.dumps with ensure_ascii.
func pyJSONString(out *strings.Builder, s string) {
	out.WriteByte('"')
	for _, r := range s {
		switch {
		case r == '"':
			out.WriteString(`\"`)
		case r == '\\':
			out.WriteString(`\\`)
		case r == '\n':
			out.WriteString(`\n`)
		case r == '\r':
			out.WriteString(`\r`)
		case r == '\t':
			out.WriteString(`\t`)
		case r == '\b':
			out.WriteString(`\b`)
		case r == '\f':
			out.WriteString(`\f`)
		case r < 0x20 || (r >= 0x7f && r < 0x10000) || r == utf8.RuneError:
			fmt.Fprintf(out, `\u%04x`, r)
		case r >= 0x10000:
			a, b := utf16.EncodeRune(r)
			fmt.Fprintf(out, `\u%04x\u%04x`, a, b)
		default:
			out.WriteRune(r)
		}
	}
	out.WriteByte('"')
}
