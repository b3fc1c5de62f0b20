package control

import (
	"testing"

	amqp091 "github.com/onceler/onceler/internal/amqp091"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/internal/testenv"
)

// What the external tests (package control_test) use: they run the real
// tasks.Worker, which imports this package and runs a Controller of its own.

// PyNode drives Python Celery (testdata/*.py) against a node.
type PyNode = node

// NewPyNode describes the node name that serves queue on the broker at url;
// extraEnv goes to every Python process.
func NewPyNode(t *testing.T, name, queue, url string, extraEnv ...string) *PyNode {
	return &node{name: name, queue: queue, url: url, py: testenv.Python(t), shutdown: make(chan struct{}), extraEnv: extraEnv}
}

// Inspect is `celery inspect <method>` of the node: its reply.
func (n *node) Inspect(t *testing.T, method string) any { return n.inspect(t, method) }

// Celery runs the celery command line with the test app.
func (n *node) Celery(t *testing.T, args ...string) []byte { return n.celery(t, args...) }

// Client runs testdata/client.py against the node.
func (n *node) Client(t *testing.T, args ...string) map[string]any { return n.client(t, args...) }

// Script runs testdata/<name> NODE args... against the node.
func (n *node) Script(t *testing.T, name string, args ...string) map[string]any {
	return n.script(t, name, args...)
}

// CheckCeleryEvents is checkCeleryEvents.
func CheckCeleryEvents(t *testing.T, n *PyNode, start func(), wantResult string) {
	t.Helper()
	checkCeleryEvents(t, n, start, wantResult)
}

// JSONEqual reports whether a and b encode to the same JSON.
func JSONEqual(a, b any) bool { return jsonEqual(a, b) }

// Connected reports whether c holds its broker connection.
func Connected(c *Controller) bool { return c.connected.Load() }

// Publishing is a task message as amqp091 publishes it.
func Publishing(p *celeryproto.Publishing) amqp091.Publishing { return publishing(p) }

// Processed sums a worker's Stats()["total"].
func Processed(stats map[string]any) int64 { return processed(stats) }

// Queue is the queue the node serves.
func (n *PyNode) Queue() string { return n.queue }

// Name is the node name.
func (n *PyNode) Name() string { return n.name }
