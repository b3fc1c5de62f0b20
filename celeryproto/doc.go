// Package celeryproto reads and writes the Celery wire protocol: task messages
// (protocol 1 and 2), their serializers and compression, rpc backend results,
// and the payloads of events and remote-control replies. It is pure: bytes
// and headers in, typed values out, with no network access.
package celeryproto
