// Command onceler runs Celery tasks written in Go from RabbitMQ, with a
// durable idempotency record in PostgreSQL so that each effect happens once.
// It serves the demo tasks (package demo); a binary of your own serves your
// tasks with the same command (package cmd, and docs/example).
//
// Run "onceler help" for the subcommands, and "onceler COMMAND --help" for
// the flags of each; every flag can also be set with an ONCELER_* environment
// variable (the flag wins). docs/cli.md holds the help text of every command.
package main

import (
	"context"

	"github.com/onceler/onceler/cmd"
	"github.com/onceler/onceler/demo"
	"github.com/onceler/onceler/tasks"
)

func main() {
	cmd.Main(cmd.App{
		Name: "onceler",
		Register: func(_ context.Context, reg *tasks.Registry, env cmd.Env) error {
			return demo.Register(reg, env.Pool, demo.WithLogger(env.Logger))
		},
		Migrate: demo.Migrate,
	})
}
