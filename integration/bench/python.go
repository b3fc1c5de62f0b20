package main

import (
	"context"
	_ "embed"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

//go:embed celery_worker.py
var celeryWorkerPy []byte

// runPython drains queue with a Python Celery 5.2.6 prefork worker
// (concurrency = cores, acks_late) running celery_worker.py, and measures
// its rate from the first to the last completion time it recorded.
func (b *bench) runPython(ctx context.Context, r *row, queue, schema string) error {
	dir, err := os.MkdirTemp("", "onceler-bench-py")
	if err != nil {
		return err
	}
	defer func() { _ = os.RemoveAll(dir) }()
	if err := os.WriteFile(filepath.Join(dir, "celery_worker.py"), celeryWorkerPy, 0o644); err != nil {
		return err
	}
	logPath := filepath.Join(dir, "worker.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		return err
	}
	defer func() { _ = logFile.Close() }()
	cmd := exec.Command(b.o.python, "-m", "celery", "-A", "celery_worker", "worker",
		"--concurrency", strconv.Itoa(runtime.NumCPU()), "--pool", "prefork", "-Q", queue,
		"--without-gossip", "--without-mingle", "--without-heartbeat", "-O", "fair", "--loglevel", "WARNING")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "BENCH_BROKER_URL="+b.o.amqpURL, "BENCH_DSN="+b.o.dbURL,
		"BENCH_SCHEMA="+pgx.Identifier{schema}.Sanitize(), "PYTHONDONTWRITEBYTECODE=1")
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start the Python worker: %w", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	stopped := false
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		_ = cmd.Process.Signal(syscall.SIGTERM) // warm shutdown
		select {
		case <-exited:
		case <-time.After(30 * time.Second):
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) // the group this bench started
			<-exited
		}
	}
	defer stop()

	deadline := time.Now().Add(b.o.timeout)
	var first, last time.Time
	poll := func() (int, error) {
		var n int
		var f, l *time.Time
		err := b.queryOnce(ctx, fmt.Sprintf(`SELECT count(*), min(completed_at), max(completed_at) FROM %s.py_records
WHERE status = 'completed'`, pgx.Identifier{schema}.Sanitize()), &n, &f, &l)
		if f != nil {
			first, last = *f, *l
		}
		return n, err
	}
	for {
		select {
		case err := <-exited:
			exited <- err
			out, _ := os.ReadFile(logPath)
			return fmt.Errorf("the Python worker exited: %v\n%s", err, out)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
		// Wait for the queue to empty before touching the database.
		if d, err := b.broker.depth(queue); err != nil || d > 0 {
			if time.Now().After(deadline) {
				return fmt.Errorf("python worker: %d messages left after the timeout", d)
			}
			continue
		}
		n, err := poll()
		if err != nil {
			return err
		}
		r.polls++
		if n >= r.n {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("python worker: %d of %d after the timeout", n, r.n)
		}
	}
	stop()
	if !last.After(first) {
		return fmt.Errorf("python worker: no time between first and last completion")
	}
	r.rate = float64(r.n-1) / last.Sub(first).Seconds()
	return nil
}

// queryOnce runs one query on a connection of its own and scans its row.
func (b *bench) queryOnce(ctx context.Context, sql string, dest ...any) error {
	c, err := pgx.Connect(ctx, b.o.dbURL)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer func() { _ = c.Close(context.WithoutCancel(ctx)) }()
	if err := c.QueryRow(ctx, sql).Scan(dest...); err != nil {
		return fmt.Errorf("query: %w", err)
	}
	return nil
}
