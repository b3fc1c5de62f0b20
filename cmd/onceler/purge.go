package main

import (
	"context"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"

	"github.com/onceler/onceler/idempotency"
)

func purgeCommand() *command {
	return &command{
		name:    "purge",
		summary: "delete finished records older than a duration (retention)",
		long: `Deletes completed, failed and skipped records last updated longer ago than
--older-than, and the repeat events (what 'onceler repeats' reports) older than
that, in batches, printing progress. Claimed and held records are kept: they
still decide what a redelivery does. A deleted record no longer
catches a duplicate of its operation, so keep records longer than any producer
may resend a message. --dry-run counts what would be deleted, per task and
status, and deletes nothing.`,
		setup: func(a *app, fs *flagSet) func(context.Context, []string) error {
			var (
				d         dbFlags
				olderThan string
				batch     int
				dryRun    bool
			)
			d.define(fs)
			fs.String(&olderThan, "older-than", "DURATION", "", "delete records last updated before now minus this, e.g. 720h or 30d (required)")
			fs.Int(&batch, "batch-size", 1000, "records deleted per transaction")
			fs.Bool(&dryRun, "dry-run", "only count what would be deleted")
			return func(ctx context.Context, args []string) error {
				if len(args) > 0 {
					return usagef("purge", "unexpected argument %q", args[0])
				}
				if olderThan == "" {
					return usagef("purge", "--older-than is required, e.g. --older-than 30d")
				}
				dur, err := parseSince("purge", "--older-than", olderThan)
				if err != nil {
					return err
				}
				if batch <= 0 {
					return usagef("purge", "--batch-size must be positive")
				}
				pool, store, err := openStore(ctx, "purge", d, zap.NewNop())
				if err != nil {
					return err
				}
				defer pool.Close()
				defer store.Close()
				return a.purge(ctx, pool, store, d.schema, olderThan, time.Now().Add(-dur), batch, dryRun)
			}
		},
	}
}

func (a *app) purge(ctx context.Context, pool *pgxpool.Pool, store *idempotency.Store, schema, olderThan string, before time.Time, batch int, dryRun bool) error {
	cutoff := "older than " + olderThan
	if dryRun {
		counts, events, err := purgeCounts(ctx, pool, schema, before)
		if err != nil {
			return fmt.Errorf("purge: %s", schemaHint(schema, err))
		}
		var total int64
		for _, c := range counts {
			total += c.n
		}
		fmt.Fprintf(a.stdout, "dry run: would delete %d records and %d repeat events %s\n", total, events, cutoff)
		if len(counts) > 0 {
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "TASK\tSTATUS\tRECORDS")
			for _, c := range counts {
				fmt.Fprintf(tw, "%s\t%s\t%d\n", c.task, c.status, c.n)
			}
			_ = tw.Flush()
		}
		return nil
	}
	fmt.Fprintf(a.stdout, "deleting records and repeat events %s, %d per batch\n", cutoff, batch)
	var total idempotency.PurgeResult
	for {
		res, err := store.Purge(ctx, idempotency.PurgeParams{Before: before, BatchSize: batch, MaxBatches: 1})
		total.Records += res.Records
		total.Events += res.Events
		total.Batches += res.Batches
		if err != nil {
			if ctx.Err() != nil {
				return fmt.Errorf("purge interrupted after deleting %d records and %d repeat events", total.Records, total.Events)
			}
			return fmt.Errorf("purge (after deleting %d records): %s", total.Records, schemaHint(schema, err))
		}
		if res.Records == 0 && res.Events == 0 {
			break
		}
		fmt.Fprintf(a.stdout, "  deleted %d records, %d repeat events so far\n", total.Records, total.Events)
		if res.Records < int64(batch) && res.Events < int64(batch) {
			break
		}
	}
	fmt.Fprintf(a.stdout, "deleted %d records and %d repeat events\n", total.Records, total.Events)
	return nil
}

type purgeCount struct {
	task, status string
	n            int64
}

// purgeCounts counts what Purge would delete: the records in a final state
// (completed, failed, skipped) last updated before the cutoff, and the
// repeat events before it. Claimed and held records are never purged.
func purgeCounts(ctx context.Context, pool *pgxpool.Pool, schema string, before time.Time) ([]purgeCount, int64, error) {
	records := pgx.Identifier{schema, "records"}.Sanitize()
	events := pgx.Identifier{schema, "events"}.Sanitize()
	rows, err := pool.Query(ctx, `SELECT task, status, count(*) FROM `+records+`
		WHERE status IN ('completed', 'failed', 'skipped') AND updated_at < $1
		GROUP BY task, status ORDER BY task, status`, before)
	if err != nil {
		return nil, 0, err
	}
	var out []purgeCount
	for rows.Next() {
		var c purgeCount
		if err := rows.Scan(&c.task, &c.status, &c.n); err != nil {
			rows.Close()
			return nil, 0, err
		}
		out = append(out, c)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, 0, err
	}
	var n int64
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+events+` WHERE at < $1`, before).Scan(&n); err != nil {
		return nil, 0, err
	}
	return out, n, nil
}
