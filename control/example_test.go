package control_test

import (
	"context"

	"github.com/onceler/onceler/control"
	"github.com/onceler/onceler/tasks"
)

// The controller is made first (it is the worker's Observer), then the
// worker, then the two are joined with SetWorker.
func Example() {
	node, err := control.NodeName("") // "onceler-<pid>@<host>"
	if err != nil {
		panic(err)
	}
	ctl, err := control.New(nil, control.Config{
		URL:        "amqp://guest:guest@127.0.0.1:5672//",
		NodeName:   node,
		TaskEvents: true, // --events
	})
	if err != nil {
		panic(err)
	}
	w, err := tasks.NewWorker(tasks.NewRegistry(), tasks.Config{Hostname: node, Observer: ctl})
	if err != nil {
		panic(err)
	}
	ctl.SetWorker(control.FromTasks(w))
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // a real program runs both until it is told to stop
	_ = ctl.Run(ctx)
	_ = w.Run(ctx)
}
