package control_test

import (
	"context"
	"time"

	"github.com/onceler/onceler/amqp"
	"github.com/onceler/onceler/control"
	"github.com/onceler/onceler/tasks"
)

// A tasks.Worker runs a Controller of its own, on its broker and under its
// node name: nothing to wire. TaskEvents is Celery's -E; NoControl turns
// the remote control off.
func Example() {
	w, err := tasks.NewWorker(tasks.NewRegistry(), tasks.Config{
		Broker:     amqp.Config{URL: "amqp://guest:guest@127.0.0.1:5672//"},
		TaskEvents: true, // --events
	})
	if err != nil {
		panic(err)
	}
	_ = w.Controller().NodeName() // w.Hostname(): "onceler-<pid>@<host>"
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // a real program runs the worker until it is told to stop
	_ = w.Run(ctx)
}

// A Controller configured otherwise runs beside a worker that runs none
// (NoControl): it is made first (it is the worker's Observer), then the
// worker, then the two are joined with SetWorker.
func ExampleNew() {
	node, err := control.NodeName("") // "onceler-<pid>@<host>"
	if err != nil {
		panic(err)
	}
	broker := amqp.Config{URL: "amqp://guest:guest@127.0.0.1:5672//"}
	ctl, err := control.New(nil, control.Config{
		URL:       broker.URL,
		NodeName:  node,
		Heartbeat: 5 * time.Second,
	})
	if err != nil {
		panic(err)
	}
	w, err := tasks.NewWorker(tasks.NewRegistry(), tasks.Config{Broker: broker, Hostname: node, Observer: ctl, NoControl: true})
	if err != nil {
		panic(err)
	}
	ctl.SetWorker(w)
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // a real program runs both until it is told to stop
	_ = ctl.Run(ctx)
	_ = w.Run(ctx)
}
