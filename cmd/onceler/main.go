// Command onceler runs Celery tasks written in Go from RabbitMQ, with a
// durable idempotency record in PostgreSQL so that each effect happens once.
//
// Run "onceler help" for the subcommands, and "onceler COMMAND --help" for
// the flags of each; every flag can also be set with an ONCELER_* environment
// variable (the flag wins). docs/cli.md holds the help text of every command.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	// The first signal asks for a graceful shutdown; restoring the default
	// handling then lets a second signal end the process at once.
	context.AfterFunc(ctx, stop)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "onceler:", err)
		var u *usageError
		if errors.As(err, &u) {
			os.Exit(2)
		}
		os.Exit(1)
	}
}
