// Package integration holds the end-to-end, replay and fault-injection tests
// that run onceler against real RabbitMQ, PostgreSQL and Python Celery.
package integration
