package cmd

import (
	"context"
	"fmt"
	"text/tabwriter"
	"time"

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
			fs.CommandLineOnly("older-than")
			fs.Int(&batch, "batch-size", 1000, "records deleted per transaction")
			fs.Bool(&dryRun, "dry-run", "only count what would be deleted")
			return func(ctx context.Context, args []string) error {
				if len(args) > 0 {
					return usagef("purge", "unexpected argument %q", args[0])
				}
				if olderThan == "" {
					if env, set := fs.ignoredEnv(a.getenv, "older-than"); set {
						return usagef("purge", "--older-than is required on the command line, e.g. --older-than 30d (%s is ignored: what purge deletes is never taken from the environment)", env)
					}
					return usagef("purge", "--older-than is required, e.g. --older-than 30d")
				}
				dur, err := parseSince("purge", "--older-than", olderThan)
				if err != nil {
					return err
				}
				if batch <= 0 {
					return usagef("purge", "--batch-size must be positive")
				}
				pool, store, err := openStore(ctx, "purge", d, zap.NewNop(), idempotency.BatchConfig{})
				if err != nil {
					return err
				}
				defer pool.Close()
				defer store.Close()
				if err := a.checkPrivileges(ctx, "purge", store, d.schema, idempotency.PurgePrivileges(), "--grant-admin-to"); err != nil {
					return err
				}
				return a.purge(ctx, store, d.schema, olderThan, time.Now().Add(-dur), batch, dryRun)
			}
		},
	}
}

func (a *app) purge(ctx context.Context, store *idempotency.Store, schema, olderThan string, before time.Time, batch int, dryRun bool) error {
	cutoff := "older than " + olderThan
	if dryRun {
		res, err := store.Purge(ctx, idempotency.PurgeParams{Before: before, DryRun: true})
		if err != nil {
			return fmt.Errorf("purge: %s", schemaHint(a.prog, schema, err))
		}
		fmt.Fprintf(a.stdout, "dry run: would delete %d records and %d repeat events %s\n", res.Records, res.Events, cutoff)
		if len(res.Counts) > 0 {
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "TASK\tSTATUS\tRECORDS")
			for _, c := range res.Counts {
				fmt.Fprintf(tw, "%s\t%s\t%d\n", c.Task, c.Status, c.Records)
			}
			_ = tw.Flush()
		}
		return nil
	}
	fmt.Fprintf(a.stdout, "deleting records and repeat events %s, %d per batch\n", cutoff, batch)
	total, err := store.Purge(ctx, idempotency.PurgeParams{Before: before, BatchSize: batch, Progress: func(sofar idempotency.PurgeResult) {
		fmt.Fprintf(a.stdout, "  deleted %d records, %d repeat events so far\n", sofar.Records, sofar.Events)
	}})
	if err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("purge interrupted after deleting %d records and %d repeat events", total.Records, total.Events)
		}
		return fmt.Errorf("purge (after deleting %d records): %s", total.Records, schemaHint(a.prog, schema, err))
	}
	fmt.Fprintf(a.stdout, "deleted %d records and %d repeat events\n", total.Records, total.Events)
	return nil
}
