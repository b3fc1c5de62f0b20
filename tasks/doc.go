// Package tasks is onceler's user-facing API: typed Celery task handlers with
// their operation key, effect mode and stale-claim policy, and the worker
// that consumes, claims, runs, completes, replies and acknowledges.
package tasks
