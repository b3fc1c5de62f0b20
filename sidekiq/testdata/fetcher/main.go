// Command fetcher is a worker process for the sidekiq package's tests: it
// runs a Client (heartbeat every 200 ms, heartbeat keys living 2 s),
// prints its identity, fetches N jobs without settling them, prints each
// jid and then waits to be killed.
//
//	fetcher REDIS_URL QUEUE N
package main

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/onceler/onceler/sidekiq"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "fetcher:", err)
		os.Exit(1)
	}
}

func run() error {
	if len(os.Args) != 4 {
		return fmt.Errorf("usage: fetcher REDIS_URL QUEUE N")
	}
	n, err := strconv.Atoi(os.Args[3])
	if err != nil {
		return err
	}
	c, err := sidekiq.New(sidekiq.Config{URL: os.Args[1], Queues: []string{os.Args[2]},
		Heartbeat: 200 * time.Millisecond, HeartbeatTTL: 2 * time.Second})
	if err != nil {
		return err
	}
	ctx := context.Background()
	go func() { _ = c.Run(ctx, nil) }()
	fmt.Println("identity", c.Identity())
	for range n {
		j, err := c.Fetch(ctx)
		if err != nil {
			return err
		}
		c.Begin(j)
		fmt.Println("fetched", j.JID)
	}
	select {}
}
