// Command onceler runs Celery tasks written in Go from RabbitMQ, with a
// durable idempotency record in PostgreSQL so that each effect happens once.
package main

import (
	"fmt"
	"os"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "onceler:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	return fmt.Errorf("no command given; try: onceler worker")
}
