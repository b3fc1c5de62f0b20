package control

import "github.com/onceler/onceler/amqp"

// QueuesFrom describes the worker's queue specs for Config.Queues.
func QueuesFrom(specs []amqp.QueueSpec) []Queue {
	out := make([]Queue, len(specs))
	for i, s := range specs {
		out[i] = Queue{Name: s.Name, Exchange: s.Exchange, ExchangeType: s.ExchangeType, RoutingKey: s.RoutingKey,
			Durable: s.Durable, AutoDelete: s.AutoDelete, Arguments: s.Args}
		if s.Quorum {
			if out[i].Arguments == nil {
				out[i].Arguments = map[string]any{}
			}
			out[i].Arguments["x-queue-type"] = "quorum"
		}
	}
	return out
}
