package idempotency

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Privilege is one privilege on one object of the record's schema: the
// schema itself (Object empty), a table, a sequence or a function.
type Privilege struct {
	// Kind is SCHEMA, TABLE, SEQUENCE or FUNCTION.
	Kind string
	// Object is the object's name in the schema (a function's with its
	// argument types); empty for the schema.
	Object string
	// Privilege is USAGE, SELECT, INSERT, UPDATE, DELETE or EXECUTE.
	Privilege string
}

// The kinds of object a Privilege is on.
const (
	KindSchema   = "SCHEMA"
	KindTable    = "TABLE"
	KindSequence = "SEQUENCE"
	KindFunction = "FUNCTION"
)

// completeBatchFunc is the function of migration 0005, with its arguments.
const completeBatchFunc = "complete_batch(text[], text[], text[], jsonb[])"

func privs(kind, object string, names ...string) []Privilege {
	out := make([]Privilege, len(names))
	for i, n := range names {
		out[i] = Privilege{Kind: kind, Object: object, Privilege: n}
	}
	return out
}

func join(lists ...[]Privilege) []Privilege {
	var out []Privilege
	for _, l := range lists {
		out = append(out, l...)
	}
	return out
}

var usage = privs(KindSchema, "", "USAGE")

// WorkerPrivileges are the privileges a worker needs on the record and
// nothing more: USAGE on the schema; SELECT, INSERT and UPDATE on records
// (claims, completions, failures, holds, skips, lease renewals, follow-ups);
// INSERT on events and USAGE on its id sequence (the repeats log, written
// with the state change); SELECT, INSERT and UPDATE on attempts (the crash
// count of same-database tasks); SELECT on migrations (the schema version
// check at start); EXECUTE on complete_batch (batched completions). They
// also serve the records and resolve commands.
func WorkerPrivileges() []Privilege {
	return join(usage,
		privs(KindTable, "records", "SELECT", "INSERT", "UPDATE"),
		privs(KindTable, "events", "INSERT"),
		privs(KindSequence, "events_id_seq", "USAGE"),
		privs(KindTable, "attempts", "SELECT", "INSERT", "UPDATE"),
		privs(KindTable, "migrations", "SELECT"),
		privs(KindFunction, completeBatchFunc, "EXECUTE"),
	)
}

// AdminPrivileges are WorkerPrivileges and what the repeats report and the
// purge need besides: SELECT on events, DELETE on records, events and
// attempts.
func AdminPrivileges() []Privilege {
	return join(WorkerPrivileges(),
		privs(KindTable, "events", "SELECT", "DELETE"),
		privs(KindTable, "records", "DELETE"),
		privs(KindTable, "attempts", "DELETE"),
	)
}

// ListPrivileges are what listing records (Get, List, StaleClaims) needs.
func ListPrivileges() []Privilege {
	return join(usage, privs(KindTable, "records", "SELECT"))
}

// ResolvePrivileges are what resolving held records needs.
func ResolvePrivileges() []Privilege {
	return join(usage, privs(KindTable, "records", "SELECT", "UPDATE"))
}

// RepeatsPrivileges are what the repeats report (Repeats) needs.
func RepeatsPrivileges() []Privilege {
	return join(usage, privs(KindTable, "events", "SELECT"))
}

// PurgePrivileges are what Purge needs: USAGE on the schema; SELECT and
// DELETE on records, events and attempts; and UPDATE on records, as Purge
// locks the records it deletes (SELECT ... FOR UPDATE SKIP LOCKED), which
// PostgreSQL allows only with UPDATE on the table.
func PurgePrivileges() []Privilege {
	return join(usage,
		privs(KindTable, "records", "SELECT", "UPDATE", "DELETE"),
		privs(KindTable, "events", "SELECT", "DELETE"),
		privs(KindTable, "attempts", "SELECT", "DELETE"),
	)
}

// On names the privilege's object in the schema (a sanitized identifier,
// as "onceler"): SCHEMA "onceler", TABLE "onceler".records.
func (p Privilege) On(schema string) string {
	if p.Kind == KindSchema {
		return "SCHEMA " + schema
	}
	return p.Kind + " " + schema + "." + p.Object
}

// privilegeOrder is the order privileges are listed in a GRANT.
var privilegeOrder = map[string]int{"USAGE": 0, "SELECT": 1, "INSERT": 2, "UPDATE": 3, "DELETE": 4, "EXECUTE": 5}

// GrantStatements are the GRANT statements that give role the privileges
// privs on the record in schema: one statement per object, in the order
// the objects first appear. Role and schema are quoted as identifiers.
func GrantStatements(schema, role string, privs []Privilege) []string {
	s := pgx.Identifier{schema}.Sanitize()
	r := pgx.Identifier{role}.Sanitize()
	var order []Privilege
	by := map[Privilege][]string{}
	for _, p := range privs {
		k := Privilege{Kind: p.Kind, Object: p.Object}
		if _, ok := by[k]; !ok {
			order = append(order, k)
		}
		seen := false
		for _, have := range by[k] {
			seen = seen || have == p.Privilege
		}
		if !seen {
			by[k] = append(by[k], p.Privilege)
		}
	}
	out := make([]string, len(order))
	for i, k := range order {
		slices.SortFunc(by[k], func(a, b string) int { return privilegeOrder[a] - privilegeOrder[b] })
		out[i] = "GRANT " + strings.Join(by[k], ", ") + " ON " + k.On(s) + " TO " + r
	}
	return out
}

// Grant gives role the privileges privs on the record, in one
// transaction; the schema's tables must exist (run Migrate first). Run it
// as the schema's owner (or a superuser). Granting again is harmless, and
// so is granting from several processes at once: the transaction holds
// Migrate's advisory lock, as PostgreSQL refuses concurrent GRANTs on one
// object ("tuple concurrently updated").
func (s *Store) Grant(ctx context.Context, role string, privs []Privilege) error {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("grant: begin: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := tx.Exec(ctx, migrateLockSQL, s.name); err != nil {
		return fmt.Errorf("grant: lock: %w", err)
	}
	for _, q := range GrantStatements(s.name, role, privs) {
		if _, err := tx.Exec(ctx, q); err != nil {
			return fmt.Errorf("grant to %q: %w", role, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return writeError("grant: commit", err)
	}
	return nil
}

// PrivilegeError reports privileges the session's role lacks on the
// record.
type PrivilegeError struct {
	Role    string // the session's role (current_user)
	Schema  string // the schema's name
	Missing []Privilege
}

func (e *PrivilegeError) Error() string {
	return fmt.Sprintf("idempotency: role %q lacks %s", e.Role, e.Lacks())
}

// Lacks names the missing privileges: "UPDATE on TABLE "onceler".records,
// INSERT on TABLE "onceler".events".
func (e *PrivilegeError) Lacks() string {
	s := pgx.Identifier{e.Schema}.Sanitize()
	parts := make([]string, len(e.Missing))
	for i, p := range e.Missing {
		parts[i] = p.Privilege + " on " + p.On(s)
	}
	return strings.Join(parts, ", ")
}

// privilegeSQL returns the ordinals of the privileges the session's role
// lacks, in one round trip. Objects are found by name in the catalogs
// (which needs no privilege, unlike a qualified name, which needs USAGE on
// its schema); an object that does not exist is not reported (CheckSchema
// reports a schema that is missing or old), nor anything when the schema
// does not exist. SELECT, INSERT and UPDATE on a table are also held
// through column grants (has_any_column_privilege: true for a table grant
// too); DELETE has none. USAGE on a sequence is also served by UPDATE on
// it, as nextval accepts either (the predefined role pg_write_all_data
// gives UPDATE only).
const privilegeSQL = `
SELECT current_user::text, COALESCE(array_agg(p.i ORDER BY p.i) FILTER (WHERE NOT CASE p.kind
    WHEN 'SCHEMA' THEN has_schema_privilege(n.oid, p.priv)
    WHEN 'FUNCTION' THEN COALESCE((SELECT bool_and(has_function_privilege(f.oid, p.priv))
        FROM pg_catalog.pg_proc f WHERE f.pronamespace = n.oid AND f.proname = split_part(p.obj, '(', 1)), true)
    WHEN 'SEQUENCE' THEN COALESCE((SELECT has_sequence_privilege(c.oid, p.priv)
            OR (p.priv = 'USAGE' AND has_sequence_privilege(c.oid, 'UPDATE'))
        FROM pg_catalog.pg_class c WHERE c.relnamespace = n.oid AND c.relname = p.obj), true)
    ELSE COALESCE((SELECT CASE WHEN p.priv IN ('SELECT', 'INSERT', 'UPDATE')
            THEN has_any_column_privilege(c.oid, p.priv) ELSE has_table_privilege(c.oid, p.priv) END
        FROM pg_catalog.pg_class c WHERE c.relnamespace = n.oid AND c.relname = p.obj), true)
    END), '{}')
FROM (SELECT oid FROM pg_catalog.pg_namespace WHERE nspname = $1) n
CROSS JOIN unnest($2::text[], $3::text[], $4::text[]) WITH ORDINALITY AS p(kind, obj, priv, i)`

// CheckPrivileges returns a *PrivilegeError naming the privileges of privs
// the session's role lacks on the record, nil when it has them all (or
// when the schema does not exist), or the error that kept it from looking.
func (s *Store) CheckPrivileges(ctx context.Context, privs []Privilege) error {
	kinds := make([]string, len(privs))
	objs := make([]string, len(privs))
	names := make([]string, len(privs))
	for i, p := range privs {
		kinds[i], objs[i], names[i] = p.Kind, p.Object, p.Privilege
	}
	var role *string
	var missing []int64
	// The aggregate returns one row, also when the schema does not exist.
	if err := s.pool.QueryRow(ctx, privilegeSQL, s.name, kinds, objs, names).Scan(&role, &missing); err != nil {
		return fmt.Errorf("check privileges on record schema %q: %w", s.name, err)
	}
	if len(missing) == 0 {
		return nil
	}
	e := &PrivilegeError{Schema: s.name}
	if role != nil {
		e.Role = *role
	}
	for _, i := range missing {
		e.Missing = append(e.Missing, privs[i-1])
	}
	return e
}
