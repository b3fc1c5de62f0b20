package cmd

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/logging"
	"github.com/onceler/onceler/tasks"
)

// connectTimeout bounds the first contact with a service, so an unreachable
// one gives a clear error rather than a hang.
const connectTimeout = 10 * time.Second

// dbFlags are the flags of every command that opens the record.
type dbFlags struct {
	url       string
	schema    string
	deadAfter time.Duration
}

func (d *dbFlags) define(fs *flagSet) {
	fs.Secret(&d.url, "database-url", "URL", "",
		"PostgreSQL connection string (URL or key=value); empty uses the libpq environment (PGHOST, PGUSER, PGDATABASE, ...) and defaults")
	fs.String(&d.schema, "schema", "NAME", "onceler",
		"PostgreSQL schema that holds the idempotency record")
	fs.Duration(&d.deadAfter, "database-dead-after", idempotency.DefaultDeadConnectionAfter,
		"a PostgreSQL connection that gets no answer this long (network black hole: packets dropped, no reset) is closed and replaced (TCP keepalive, TCP_USER_TIMEOUT on Linux, ping before reuse)")
}

// describeDB names the database a config points at, without its password:
// every host of a multi-host URL (libpq's host1:port1,host2:port2, which
// target_session_attrs chooses from), sockets as the host= parameter.
func describeDB(cfg *pgxpool.Config) string {
	c := cfg.ConnConfig
	u := url.URL{Scheme: "postgres", User: url.User(c.User), Path: "/" + c.Database}
	var hosts, sockets []string
	seen := map[string]bool{}
	add := func(host string, port uint16) {
		if strings.HasPrefix(host, "/") {
			if !seen[host] {
				sockets = append(sockets, host)
			}
			seen[host] = true
			return
		}
		hp := net.JoinHostPort(host, strconv.Itoa(int(port)))
		if !seen[hp] {
			hosts = append(hosts, hp)
		}
		seen[hp] = true
	}
	add(c.Host, c.Port)
	for _, f := range c.Fallbacks { // one per host, or two with sslmode=prefer
		add(f.Host, f.Port)
	}
	u.Host = strings.Join(hosts, ",")
	if len(sockets) > 0 {
		u.RawQuery = url.Values{"host": {strings.Join(sockets, ",")}}.Encode()
	}
	return u.String()
}

var (
	passwordKV = regexp.MustCompile(`(?i)(password\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s&]+)`)
	urlScheme  = regexp.MustCompile(`^[a-zA-Z][a-zA-Z0-9+.-]*:`)
)

// dsnSecrets returns what in dsn may be a password, in every spelling an
// error message may quote it: the values of password= (key=value or URL
// query, quoted or not) and a URL's userinfo after the user name (percent-
// decoded too), found without parsing, so a malformed string yields them as
// well.
func dsnSecrets(dsn string) []string {
	var out []string
	add := func(v string) {
		if v != "" {
			out = append(out, v)
		}
	}
	for _, m := range passwordKV.FindAllStringSubmatch(dsn, -1) {
		add(m[2])
		if v := strings.Trim(m[2], "'"); v != m[2] {
			add(v)
			add(strings.ReplaceAll(v, `\'`, `'`))
		}
		if v, err := url.QueryUnescape(m[2]); err == nil {
			add(v)
		}
	}
	if loc := urlScheme.FindStringIndex(dsn); loc != nil {
		rest := strings.TrimPrefix(dsn[loc[1]:], "//")
		if at := strings.LastIndex(rest, "@"); at >= 0 {
			info := rest[:at]
			if i := strings.Index(info, ":"); i >= 0 {
				info = info[i+1:]
			}
			add(info)
			if v, err := url.PathUnescape(info); err == nil {
				add(v)
			}
		}
	}
	// Longest first, so that a secret is replaced whole before a part of it.
	slices.SortFunc(out, func(a, b string) int { return len(b) - len(a) })
	return out
}

// redactDSN returns text (dsn itself, or a message that may quote it) with
// every possible password of the PostgreSQL URL or key=value string dsn
// replaced by "xxxxx".
func redactDSN(text, dsn string) string {
	for _, s := range dsnSecrets(dsn) {
		text = strings.ReplaceAll(text, s, "xxxxx")
	}
	return passwordKV.ReplaceAllString(text, "${1}xxxxx")
}

// openPool opens a pool and checks that the database answers.
func openPool(ctx context.Context, cmd string, d dbFlags, appName string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(d.url)
	if err != nil {
		return nil, usagef(cmd, "invalid --database-url %q: %v", redactDSN(d.url, d.url), redactDSN(oneLine(err), d.url))
	}
	if d.deadAfter <= 0 {
		return nil, usagef(cmd, "invalid --database-dead-after %v: must be positive", d.deadAfter)
	}
	idempotency.ConfigureDeadConnectionDetection(cfg, d.deadAfter)
	if cfg.ConnConfig.RuntimeParams == nil {
		cfg.ConnConfig.RuntimeParams = map[string]string{}
	}
	if cfg.ConnConfig.RuntimeParams["application_name"] == "" {
		cfg.ConnConfig.RuntimeParams["application_name"] = appName
	}
	if cmd == "worker" && !strings.Contains(d.url, "pool_max_conns") {
		// pgxpool's own default (the CPUs, at least 4) would leave the
		// worker's same-database tasks waiting for connections.
		cfg.MaxConns = tasks.DefaultPoolConns
	}
	where := describeDB(cfg)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("cannot use PostgreSQL at %s: %s", where, oneLine(err))
	}
	pctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		var cve *tls.CertificateVerificationError
		if errors.As(err, &cve) {
			return nil, fmt.Errorf("PostgreSQL at %s: its TLS certificate was refused: %s; check the URL's sslrootcert (the CA that signed the server's certificate) and that its host is a name the certificate holds", where, oneLine(cve))
		}
		return nil, fmt.Errorf("cannot reach PostgreSQL at %s: %s; check --database-url (ONCELER_DATABASE_URL) and that the server is running", where, oneLine(err))
	}
	return pool, nil
}

// openStore opens the pool and the record store on it, with batch as its
// BatchConfig (the zero value: the defaults).
func openStore(ctx context.Context, cmd string, d dbFlags, logger *zap.Logger, batch idempotency.BatchConfig) (*pgxpool.Pool, *idempotency.Store, error) {
	if err := checkIdent(cmd, "--schema", d.schema); err != nil {
		return nil, nil, err
	}
	pool, err := openPool(ctx, cmd, d, "onceler "+cmd)
	if err != nil {
		return nil, nil, err
	}
	store, err := idempotency.New(pool, idempotency.Config{Schema: d.schema, Logger: logger, Batch: batch})
	if err != nil {
		pool.Close()
		return nil, nil, fmt.Errorf("open record: %w", err)
	}
	return pool, store, nil
}

var identRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,62}$`)

func checkIdent(cmd, flagName, v string) error {
	if !identRE.MatchString(v) {
		return usagef(cmd, "invalid %s %q: use letters, digits and '_' (a PostgreSQL identifier)", flagName, v)
	}
	return nil
}

// oneLine flattens an error message to one line.
func oneLine(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Message + " (SQLSTATE " + pgErr.Code + ")"
	}
	var opErr *net.OpError
	if errors.As(err, &opErr) {
		return opErr.Error()
	}
	return strings.Join(strings.Fields(err.Error()), " ")
}

// noRows reports whether err says a row is missing.

// newLogger builds the process logger from --log-level and --log-format,
// writing to w.
func newLogger(cmd, level, format string, w io.Writer) (*zap.Logger, error) {
	lvl, err := zapcore.ParseLevel(level)
	if err != nil {
		return nil, usagef(cmd, "invalid --log-level %q: use debug, info, warn or error", level)
	}
	logger, err := logging.New(lvl, format, w)
	if err != nil {
		return nil, usagef(cmd, "invalid --log-format %q: use json or console", format)
	}
	return logger, nil
}

// maxDays is the most days parseSince takes: 100 years.
const maxDays = 36500

// parseSince reads a duration that also accepts days ("7d", "1d12h").
func parseSince(cmd, flagName, v string) (time.Duration, error) {
	orig := v
	var days time.Duration
	if i := strings.IndexByte(v, 'd'); i > 0 {
		n, err := strconv.Atoi(v[:i])
		if err != nil {
			return 0, usagef(cmd, "invalid %s %q: use a duration such as 90m, 24h or 7d", flagName, orig)
		}
		if n > maxDays {
			// Beyond this a time.Duration wraps around (213504d would
			// read as 25 minutes).
			return 0, usagef(cmd, "invalid %s %q: at most %dd", flagName, orig, maxDays)
		}
		days = time.Duration(n) * 24 * time.Hour
		v = v[i+1:]
	}
	var rest time.Duration
	if v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			return 0, usagef(cmd, "invalid %s %q: use a duration such as 90m, 24h or 7d", flagName, orig)
		}
		rest = d
	}
	d := days + rest
	if d <= 0 || d < days {
		return 0, usagef(cmd, "invalid %s %q: must be positive", flagName, orig)
	}
	return d, nil
}
