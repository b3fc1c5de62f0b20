package cmd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"

	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/clip"
	"github.com/onceler/onceler/internal/shellquote"
)

func migrateCommand() *command {
	return &command{
		name:    "migrate",
		summary: "create or update the record schema and the binary's own tables",
		long: `Applies the idempotency record's schema migrations that are not applied
yet, then creates or updates the tables of the binary's own tasks
(cmd.App.Migrate; in onceler's own binary, the demo tables in schema
onceler_demo). Safe to run again and from several machines at once
(advisory locks serialise both steps). Run it before the first worker
starts, and after each upgrade of the binary.

Run it as the role that owns the schema. --grant-to gives a worker's role
the privileges on the record it needs and nothing more, --grant-admin-to
those and what 'onceler repeats' and 'onceler purge' need; both are applied
after the migrations, also to a schema already current, and granting again
is harmless. The binary's own tables get no grants: give them to the
worker's role yourself. --print-grants prints the GRANT statements instead,
for a DBA to apply, and connects to nothing (docs/security.md).`,
		setup: func(a *app, fs *flagSet) func(context.Context, []string) error {
			var (
				d               dbFlags
				workers, admins []string
				printOnly       bool
			)
			d.define(fs)
			fs.List(&workers, "grant-to", "ROLE", "after migrating, grant this PostgreSQL role what a worker needs on the record (USAGE on the schema, the statements it runs on its tables); repeat the flag or separate roles with commas")
			fs.List(&admins, "grant-admin-to", "ROLE", "after migrating, grant this PostgreSQL role what a worker needs and what 'repeats' and 'purge' need besides (SELECT on events, DELETE on records, events and attempts); repeat the flag or separate roles with commas")
			fs.Bool(&printOnly, "print-grants", "print the GRANT statements of --grant-to and --grant-admin-to for --schema, and do nothing else (no connection, no migration)")
			fs.CommandLineOnly("print-grants")
			fs.skipSecrets = func() bool { return printOnly }
			return func(ctx context.Context, args []string) error {
				if len(args) > 0 {
					return usagef("migrate", "unexpected argument %q", args[0])
				}
				if err := checkIdent("migrate", "--schema", d.schema); err != nil {
					return err
				}
				if printOnly {
					if len(workers)+len(admins) == 0 {
						return usagef("migrate", "--print-grants needs --grant-to or --grant-admin-to")
					}
					for _, g := range grantsOf(workers, admins) {
						for _, q := range idempotency.GrantStatements(d.schema, g.role, g.privs) {
							fmt.Fprintln(a.stdout, q+";")
						}
					}
					return nil
				}
				pool, store, err := openStore(ctx, "migrate", d, zap.NewNop(), idempotency.BatchConfig{})
				if err != nil {
					return err
				}
				defer pool.Close()
				defer store.Close()
				if err := a.migrate(ctx, pool, store, d.schema); err != nil {
					return err
				}
				ms, err := idempotency.Migrations()
				if err != nil {
					return err
				}
				fmt.Fprintf(a.stdout, "schema %q is at version %d\n", d.schema, ms[len(ms)-1].Version)
				for _, g := range grantsOf(workers, admins) {
					if err := store.Grant(ctx, g.role, g.privs); err != nil {
						return fmt.Errorf("grant %s privileges on the record schema %q to role %q: %s", g.what, d.schema, g.role, oneLine(err))
					}
					fmt.Fprintf(a.stdout, "role %q has the %s privileges on schema %q\n", g.role, g.what, d.schema)
				}
				return nil
			}
		},
	}
}

// grant is the privileges one role is given by migrate.
type grant struct {
	role, what string
	privs      []idempotency.Privilege
}

// grantsOf lists the grants of --grant-to (workers) and --grant-admin-to.
func grantsOf(workers, admins []string) []grant {
	var out []grant
	for _, r := range workers {
		out = append(out, grant{r, "worker", idempotency.WorkerPrivileges()})
	}
	for _, r := range admins {
		out = append(out, grant{r, "admin", idempotency.AdminPrivileges()})
	}
	return out
}

// checkPrivileges refuses to go on when the session's role lacks a
// privilege of need on the record, in one line naming what is missing and
// the migrate flag that grants it (--grant-to or --grant-admin-to), in a
// command a shell runs as printed (the role quoted when it needs to be).
func (a *app) checkPrivileges(ctx context.Context, cmd string, store *idempotency.Store, schema string, need []idempotency.Privilege, grantFlag string) error {
	cctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	err := store.CheckPrivileges(cctx, need)
	var pe *idempotency.PrivilegeError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &pe):
		return fmt.Errorf("PostgreSQL role %q lacks %s, which '%s %s' needs: run '%s migrate --schema %s %s %s' as the schema's owner (docs/security.md)",
			pe.Role, pe.Lacks(), a.prog, cmd, shellquote.Quote(a.prog), shellquote.Quote(schema), grantFlag, shellquote.Quote(pe.Role))
	default:
		return fmt.Errorf("check the privileges on the record schema %q: %s", schema, oneLine(err))
	}
}

var statuses = []idempotency.Status{
	idempotency.StatusClaimed, idempotency.StatusCompleted, idempotency.StatusFailed,
	idempotency.StatusHeld, idempotency.StatusSkipped,
}

// migrate applies the record schema, then the binary's own migration.
func (a *app) migrate(ctx context.Context, pool *pgxpool.Pool, store *idempotency.Store, schema string) error {
	if err := store.Migrate(ctx); err != nil {
		return fmt.Errorf("migrate the record schema %q: %s", schema, oneLine(err))
	}
	if a.user.Migrate == nil {
		return nil
	}
	// The binary's own migration runs under a lock of its own, so that
	// migrations started at once on several machines run one after another,
	// as the record's do.
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("create the binary's own tables: %s", oneLine(err))
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", appMigrateLock); err != nil {
		return fmt.Errorf("create the binary's own tables: lock: %s", oneLine(err))
	}
	defer func() {
		if _, err := conn.Exec(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock($1)", appMigrateLock); err != nil {
			_ = conn.Conn().Close(context.WithoutCancel(ctx)) // a closed session releases its locks
		}
	}()
	err = callUser("Migrate", func() error { return a.user.Migrate(ctx, pool) })
	if err != nil {
		return fmt.Errorf("create the binary's own tables: %s", strings.Join(strings.Fields(err.Error()), " "))
	}
	return nil
}

// appMigrateLock is the advisory lock key of the binary's own migration.
const appMigrateLock int64 = 0x6f6e63656c6d6967 // "oncelmig"

func parseStatus(cmd, v string) (idempotency.Status, error) {
	if v == "" {
		return "", nil
	}
	names := make([]string, len(statuses))
	for i, s := range statuses {
		if string(s) == v {
			return s, nil
		}
		names[i] = string(s)
	}
	return "", usagef(cmd, "invalid --status %q: use one of %s", v, strings.Join(names, ", "))
}

func recordsCommand() *command {
	return &command{
		name:    "records",
		summary: "list and inspect idempotency records",
		long: `Lists the records of the idempotency record, by task and key, filtered by
task, key and status; --stale lists the claims whose lease has lapsed without
an outcome. With both --task and --key it shows the one record in full
(result, error, reason). --json prints JSON instead of a table.`,
		setup: func(a *app, fs *flagSet) func(context.Context, []string) error {
			var (
				d                 dbFlags
				task, key, status string
				limit             int
				asJSON, stale     bool
			)
			d.define(fs)
			fs.String(&task, "task", "NAME", "", "only records of this task")
			fs.String(&key, "key", "KEY", "", "only records with this operation key")
			fs.String(&status, "status", "STATUS", "", "only records in this status: claimed, completed, failed, held or skipped")
			fs.Bool(&stale, "stale", "only claims whose lease has lapsed without an outcome (their claimant stopped; the stale-claim policy settles them at their next delivery)")
			fs.Int(&limit, "limit", 100, "list at most this many records")
			fs.Bool(&asJSON, "json", "print JSON")
			return func(ctx context.Context, args []string) error {
				if len(args) > 0 {
					return usagef("records", "unexpected argument %q", args[0])
				}
				st, err := parseStatus("records", status)
				if err != nil {
					return err
				}
				if limit <= 0 {
					return usagef("records", "--limit must be positive")
				}
				pool, store, err := openStore(ctx, "records", d, zap.NewNop(), idempotency.BatchConfig{})
				if err != nil {
					return err
				}
				defer pool.Close()
				defer store.Close()
				if err := a.checkPrivileges(ctx, "records", store, d.schema, idempotency.ListPrivileges(), "--grant-to"); err != nil {
					return err
				}
				recs, err := store.List(ctx, idempotency.Filter{Task: task, Key: key, Status: st, Stale: stale, Limit: limit})
				if err != nil {
					return fmt.Errorf("list records: %s", schemaHint(a.prog, d.schema, err))
				}
				if asJSON {
					return writeJSON(a.stdout, recordsJSON(recs))
				}
				if task != "" && key != "" && len(recs) == 1 {
					printRecord(a.stdout, a.prog, recs[0])
					return nil
				}
				printRecords(a.stdout, recs)
				if len(recs) == limit {
					fmt.Fprintf(a.stdout, "(the first %d; --limit shows more)\n", limit)
				}
				return nil
			}
		},
	}
}

// schemaHint explains an error caused by a schema that was never migrated.
func schemaHint(prog, schema string, err error) string {
	if strings.Contains(err.Error(), "42P01") {
		return fmt.Sprintf("the record schema %q does not exist: run '%s migrate' (or check --schema)", schema, prog)
	}
	return oneLine(err)
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return fmt.Errorf("write JSON: %w", err)
	}
	return nil
}

type recordJSON struct {
	Task         string          `json:"task"`
	Key          string          `json:"key"`
	Status       string          `json:"status"`
	Attempt      int             `json:"attempt"`
	Owner        string          `json:"owner,omitempty"`
	TaskID       string          `json:"task_id,omitempty"`
	Duplicates   int             `json:"duplicates"`
	ClaimedAt    *time.Time      `json:"claimed_at,omitempty"`
	LeaseUntil   *time.Time      `json:"lease_until,omitempty"`
	CompletedAt  *time.Time      `json:"completed_at,omitempty"`
	UpdatedAt    *time.Time      `json:"updated_at,omitempty"`
	Result       json.RawMessage `json:"result,omitempty"`
	Error        string          `json:"error,omitempty"`
	Reason       string          `json:"reason,omitempty"`
	MessageBytes int             `json:"message_bytes,omitempty"`
}

func timePtr(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	u := t.UTC()
	return &u
}

func recordsJSON(recs []idempotency.Record) []recordJSON {
	out := make([]recordJSON, 0, len(recs))
	for _, r := range recs {
		out = append(out, recordJSON{
			Task: r.Task, Key: r.Key, Status: string(r.Status), Attempt: r.Attempt,
			Owner: r.Owner, TaskID: r.TaskID, Duplicates: r.Duplicates,
			ClaimedAt: timePtr(r.ClaimedAt), LeaseUntil: timePtr(r.LeaseUntil),
			CompletedAt: timePtr(r.CompletedAt), UpdatedAt: timePtr(r.UpdatedAt),
			Result: json.RawMessage(r.Result), Error: r.Error, Reason: r.Reason,
			MessageBytes: len(r.Message),
		})
	}
	return out
}

func fmtTime(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format("2006-01-02 15:04:05")
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func printRecords(w io.Writer, recs []idempotency.Record) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "TASK\tKEY\tSTATUS\tATTEMPT\tDUPLICATES\tUPDATED (UTC)\tNOTE")
	for _, r := range recs {
		note := r.Reason
		if note == "" {
			note = r.Error
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%s\t%s\n", r.Task, r.Key, r.Status, r.Attempt, r.Duplicates,
			fmtTime(r.UpdatedAt), dash(truncate(note, 60)))
	}
	_ = tw.Flush()
	fmt.Fprintf(w, "%d record(s)\n", len(recs))
}

func printRecord(w io.Writer, prog string, r idempotency.Record) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	row := func(k, v string) { fmt.Fprintf(tw, "%s:\t%s\n", k, v) }
	row("task", r.Task)
	row("key", r.Key)
	row("status", string(r.Status))
	row("attempt", strconv.Itoa(r.Attempt))
	row("duplicates", strconv.Itoa(r.Duplicates))
	row("owner", dash(r.Owner))
	row("task id", dash(r.TaskID))
	row("claimed at", fmtTime(r.ClaimedAt))
	row("lease until", fmtTime(r.LeaseUntil))
	row("completed at", fmtTime(r.CompletedAt))
	row("updated at", fmtTime(r.UpdatedAt))
	row("result", dash(string(r.Result)))
	row("error", dash(r.Error))
	row("reason", dash(r.Reason))
	msg := "-"
	if len(r.Message) > 0 {
		msg = fmt.Sprintf("%d bytes kept for '%s resolve --retry'", len(r.Message), prog)
	}
	row("message", msg)
	_ = tw.Flush()
}

// truncate folds the white space of s and cuts it to about n bytes for a
// table cell, marking the cut.
func truncate(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) <= n {
		return s
	}
	return clip.Prefix(s, n-1) + "…"
}

func repeatsCommand() *command {
	return &command{
		name:    "repeats",
		summary: "report the repeats the record caught (duplicates, takeovers, holds, ...)",
		long: `Reports, per task, what the record caught since a time: duplicates answered
with the stored result, stale claims taken over (policy retry or lookup), held
and skipped operations, argument mismatches and failures.`,
		setup: func(a *app, fs *flagSet) func(context.Context, []string) error {
			var (
				d      dbFlags
				since  string
				asJSON bool
			)
			d.define(fs)
			fs.String(&since, "since", "DURATION", "24h", "report the repeats of this last period, e.g. 90m, 24h, 7d")
			fs.Bool(&asJSON, "json", "print JSON")
			return func(ctx context.Context, args []string) error {
				if len(args) > 0 {
					return usagef("repeats", "unexpected argument %q", args[0])
				}
				dur, err := parseSince("repeats", "--since", since)
				if err != nil {
					return err
				}
				pool, store, err := openStore(ctx, "repeats", d, zap.NewNop(), idempotency.BatchConfig{})
				if err != nil {
					return err
				}
				defer pool.Close()
				defer store.Close()
				if err := a.checkPrivileges(ctx, "repeats", store, d.schema, idempotency.RepeatsPrivileges(), "--grant-admin-to"); err != nil {
					return err
				}
				from := time.Now().Add(-dur)
				stats, err := store.Repeats(ctx, from)
				if err != nil {
					return fmt.Errorf("repeats: %s", schemaHint(a.prog, d.schema, err))
				}
				if asJSON {
					return writeJSON(a.stdout, repeatsJSON(from, stats))
				}
				printRepeats(a.stdout, since, stats)
				return nil
			}
		},
	}
}

type repeatsReport struct {
	Since time.Time         `json:"since"`
	Tasks []repeatsTaskJSON `json:"tasks"`
}

type repeatsTaskJSON struct {
	Task       string `json:"task"`
	Duplicates int64  `json:"duplicates"`
	Takeovers  int64  `json:"takeovers"`
	Held       int64  `json:"held"`
	Skipped    int64  `json:"skipped"`
	Mismatches int64  `json:"mismatches"`
	Failures   int64  `json:"failures"`
}

func repeatsJSON(from time.Time, stats []idempotency.RepeatStats) repeatsReport {
	r := repeatsReport{Since: from.UTC().Truncate(time.Second), Tasks: []repeatsTaskJSON{}}
	for _, s := range stats {
		r.Tasks = append(r.Tasks, repeatsTaskJSON{
			Task: s.Task, Duplicates: s.Duplicates, Takeovers: s.Takeovers, Held: s.Held,
			Skipped: s.Skipped, Mismatches: s.Mismatches, Failures: s.Failures,
		})
	}
	return r
}

func printRepeats(w io.Writer, since string, stats []idempotency.RepeatStats) {
	if len(stats) == 0 {
		fmt.Fprintf(w, "no repeats in the last %s\n", since)
		return
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "TASK\tDUPLICATES\tTAKEOVERS\tHELD\tSKIPPED\tMISMATCHES\tFAILURES")
	row := func(task string, n [6]int64) {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d\n", task, n[0], n[1], n[2], n[3], n[4], n[5])
	}
	var total [6]int64
	for _, s := range stats {
		n := [6]int64{s.Duplicates, s.Takeovers, s.Held, s.Skipped, s.Mismatches, s.Failures}
		row(s.Task, n)
		for i := range n {
			total[i] += n[i]
		}
	}
	row("total", total)
	_ = tw.Flush()
}
