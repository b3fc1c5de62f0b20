// Package amqp is onceler's thin adapter over github.com/rabbitmq/amqp091-go:
// it owns connecting with backoff, reconnecting, kombu-compatible topology,
// QoS, late acknowledgement bound to the channel a delivery came on, and
// publishing with confirms.
package amqp
