// Package idempotency keeps the durable record that makes a task's effect
// happen once: a row per (task name, operation key) in PostgreSQL, claimed
// atomically, fenced by a claim token, and completed only when the work is
// done.
package idempotency
