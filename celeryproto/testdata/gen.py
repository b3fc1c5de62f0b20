#!/usr/bin/python3
"""Regenerate the golden vectors in testdata/golden from real Celery.

Run with the system Python that has Celery 5.2.6 / kombu 5.2.4:

    /usr/bin/python3 celeryproto/testdata/gen.py [amqp://guest:guest@127.0.0.1:5672//]

Each vector is sent by Celery itself (send_task / signatures / canvas) to a
fresh queue on the local RabbitMQ and fetched back raw with basic_get, so the
properties, headers and body bytes are what Celery really publishes. One JSON
file per vector holds the properties, the headers (JSON keeps their types:
null, bool, int, float, string, list, object), the body as base64 and the
values a decoder must find.

Not produced by Celery here, and said so in the files:
  * brotli and zstd bodies: kombu 5.2.4 in Debian has no brotli/zstandard
    module, so the Go tests compress a captured body with Go's libraries.
  * kombu >= 5.3 "__type__" JSON envelopes: kombu 5.2 never emits them, so
    those bodies are hand-written below in the format kombu 5.3 writes.
"""
import base64
import datetime
import json
import os
import sys
import uuid

from celery import Celery, chain
from kombu import Connection, Exchange, Queue
from kombu.serialization import loads

URL = sys.argv[1] if len(sys.argv) > 1 else "amqp://guest:guest@127.0.0.1:5672//"
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
UTC = datetime.timezone.utc

app = Celery("golden", broker=URL, backend="rpc://")
app.conf.task_default_queue = "unused"


@app.task(name="tasks.add")
def add(x, y):
    return x + y


@app.task(name="tasks.mul")
def mul(x, y):
    return x * y


@app.task(name="tasks.on_error")
def on_error(task_id):
    return task_id


def jsonable(v):
    if isinstance(v, datetime.datetime):
        return {"$time": v.isoformat()}
    if isinstance(v, bytes):
        return {"$bytes": base64.b64encode(v).decode()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    return v


def fetch(conn, queue):
    ch = conn.default_channel
    ch.auto_decode = False  # keep the body bytes exactly as published
    for _ in range(50):
        m = ch.basic_get(queue, no_ack=True)
        if m is not None:
            return m
        import time
        time.sleep(0.05)
    raise RuntimeError("no message in " + queue)


def expected_from(m, protocol):
    props = m.properties
    headers = props.get("application_headers") or {}
    body = loads(m.body if not headers.get("compression") else
                 __import__("kombu.compression", fromlist=["x"]).decompress(m.body, headers["compression"]),
                 props["content_type"], props.get("content_encoding", "utf-8"),
                 accept={"application/json", "application/x-msgpack", "application/x-yaml"})
    if protocol == 2:
        args, kwargs, embed = body
        tl = headers.get("timelimit") or [None, None]
        exp = {
            "task": headers["task"], "id": headers["id"],
            "args": args, "kwargs": kwargs,
            "eta": headers.get("eta"), "expires": headers.get("expires"),
            "retries": headers.get("retries", 0),
            "timelimit": list(tl),
            "root_id": headers.get("root_id"), "parent_id": headers.get("parent_id"),
            "group": headers.get("group"), "ignore_result": headers.get("ignore_result", False),
            "origin": headers.get("origin"),
            "argsrepr": headers.get("argsrepr"), "kwargsrepr": headers.get("kwargsrepr"),
            "callbacks": embed.get("callbacks"), "errbacks": embed.get("errbacks"),
            "chain": embed.get("chain"), "chord": embed.get("chord"),
        }
    else:
        tl = body.get("timelimit") or [None, None]
        exp = {
            "task": body["task"], "id": body["id"],
            "args": body["args"], "kwargs": body["kwargs"],
            "eta": body.get("eta"), "expires": body.get("expires"),
            "retries": body.get("retries", 0), "timelimit": list(tl),
            "root_id": None, "parent_id": None, "group": body.get("taskset") or body.get("group"),
            "ignore_result": False, "origin": None, "argsrepr": None, "kwargsrepr": None,
            "callbacks": body.get("callbacks"), "errbacks": body.get("errbacks"),
            "chain": None, "chord": body.get("chord"),
        }
    exp["custom_headers"] = {k: v for k, v in headers.items() if k in ("idempotency_key", "tenant")}
    exp["compression"] = headers.get("compression")
    exp["reply_to"] = props.get("reply_to")
    exp["correlation_id"] = props.get("correlation_id")
    return jsonable(exp)


def write(name, m, protocol, note=""):
    props = dict(m.properties)
    headers = props.pop("application_headers", {}) or {}
    doc = {
        "name": name,
        "producer": "celery 5.2.6 / kombu 5.2.4 (captured from RabbitMQ)",
        "note": note,
        "properties": jsonable(props),
        "headers": jsonable(headers),
        "body_b64": base64.b64encode(m.body).decode(),
        "expected": expected_from(m, protocol),
        "protocol": protocol,
    }
    with open(os.path.join(OUT, name + ".json"), "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")


def capture(conn, name, protocol, send, note=""):
    app.conf.task_protocol = protocol
    app.amqp.__dict__.pop("create_task_message", None)  # cached per protocol
    q = "golden_" + uuid.uuid4().hex[:12]
    queue = Queue(q, Exchange(q, type="direct"), routing_key=q)  # as Celery declares it
    queue(conn.default_channel).declare()
    try:
        send(q)
        write(name, fetch(conn, q), protocol, note)
    finally:
        conn.default_channel.queue_delete(q)


def main():
    os.makedirs(OUT, exist_ok=True)
    eta = datetime.datetime(2031, 5, 1, 12, 0, 0, 123456, tzinfo=UTC)
    eta0 = datetime.datetime(2031, 5, 1, 12, 0, 0, tzinfo=UTC)
    expires = datetime.datetime(2031, 5, 2, 8, 30, 0, 500000, tzinfo=UTC)
    kw = {"note": "h\u00e9llo", "big": 2**62 + 1, "ratio": 1.5, "flag": True, "none": None,
          "nested": {"b": [1, 2, {"c": "d"}], "a": -7}}
    with Connection(URL) as conn:
        for proto in (2, 1):
            p = "p%d_" % proto
            for ser in ("json", "msgpack", "yaml"):
                capture(conn, p + ser + "_basic", proto, lambda q, ser=ser: app.send_task(
                    "tasks.add", args=[2, 3], kwargs=kw, queue=q, serializer=ser))
            for comp in ("zlib", "bzip2", "lzma"):
                capture(conn, p + "json_" + comp, proto, lambda q, comp=comp: app.send_task(
                    "tasks.add", args=[2, 3], kwargs=kw, queue=q, compression=comp))
            capture(conn, p + "json_eta_expires", proto, lambda q: app.send_task(
                "tasks.add", args=[1, 1], queue=q, eta=eta, expires=expires))
            capture(conn, p + "json_eta_nofraction", proto, lambda q: app.send_task(
                "tasks.add", args=[1, 1], queue=q, eta=eta0, expires=300))
            capture(conn, p + "json_countdown", proto, lambda q: app.send_task(
                "tasks.add", args=[1, 1], queue=q, countdown=60))
            capture(conn, p + "json_timelimit", proto, lambda q: app.send_task(
                "tasks.add", args=[1, 1], queue=q, time_limit=30, soft_time_limit=10))
            capture(conn, p + "json_link", proto, lambda q: add.apply_async(
                (1, 2), queue=q, link=mul.s(10), link_error=on_error.si("x")))
            capture(conn, p + "json_headers", proto, lambda q: add.apply_async(
                (4, 5), queue=q, headers={"idempotency_key": "order-42", "tenant": "acme"}))
            capture(conn, p + "yaml_eta", proto, lambda q: app.send_task(
                "tasks.add", args=[1, 1], queue=q, eta=eta, serializer="yaml"))
            capture(conn, p + "msgpack_eta", proto, lambda q: app.send_task(
                "tasks.add", args=[1, 1], queue=q, eta=eta, serializer="msgpack"))
        app.conf.task_protocol = 2
        capture(conn, "p2_json_chain", 2, lambda q: chain(
            add.s(1, 2).set(queue=q), add.s(3).set(queue=q), mul.s(4).set(queue=q)).apply_async())
        capture(conn, "p2_json_ignore_result", 2, lambda q: add.apply_async(
            (1, 2), queue=q, ignore_result=True, priority=5))
    write_type_envelopes()


def write_type_envelopes():
    """kombu >= 5.3 JSON: hand-written, kombu 5.2 does not emit __type__."""
    tid = "3f9b3e4e-6c1e-4a43-9d43-6f0f1b0e2a11"
    body = [[{"__type__": "datetime", "__value__": "2031-05-01T12:00:00.123456+00:00"},
             {"__type__": "uuid", "__value__": "6c8f7f3e-0c9a-4c55-9f0e-3c2b1a0d9e8f"},
             {"__type__": "uuid", "__value__": {"hex": "6c8f7f3e0c9a4c559f0e3c2b1a0d9e8f"}},
             {"__type__": "decimal", "__value__": "12.50"},
             {"__type__": "bytes", "__value__": "hello"},
             {"__type__": "base64", "__value__": "aGVsbG8="},
             {"__type__": "date", "__value__": "2031-05-01"},
             {"__type__": "time", "__value__": "12:30:00"}],
            {"when": {"__type__": "datetime", "__value__": "2031-05-01T12:00:00"}},
            {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]
    raw = json.dumps(body).encode()
    headers = {"lang": "py", "task": "tasks.typed", "id": tid, "shadow": None, "eta": None,
               "expires": None, "group": None, "group_index": None, "retries": 0,
               "timelimit": [None, None], "root_id": tid, "parent_id": None,
               "argsrepr": "(...)", "kwargsrepr": "{...}", "origin": "gen1@host",
               "ignore_result": False}
    doc = {
        "name": "p2_json_kombu53_types",
        "producer": "hand-written in the format of kombu >= 5.3 (kombu 5.2 does not emit __type__)",
        "note": "bytes (UTF-8 text) and base64 decode to []byte; uuid (string or {hex}) to its canonical string; datetime/date to time.Time; uuid, decimal and time to string",
        "properties": {"content_type": "application/json", "content_encoding": "utf-8",
                       "correlation_id": tid, "delivery_mode": 2, "priority": 0},
        "headers": headers,
        "body_b64": base64.b64encode(raw).decode(),
        "protocol": 2,
        "expected": {
            "task": "tasks.typed", "id": tid,
            "args": [{"$time": "2031-05-01T12:00:00.123456+00:00"},
                     "6c8f7f3e-0c9a-4c55-9f0e-3c2b1a0d9e8f",
                     "6c8f7f3e-0c9a-4c55-9f0e-3c2b1a0d9e8f", "12.50",
                     {"$bytes": "aGVsbG8="}, {"$bytes": "aGVsbG8="},
                     {"$time": "2031-05-01T00:00:00+00:00"}, "12:30:00"],
            "kwargs": {"when": {"$time": "2031-05-01T12:00:00+00:00"}},
            "eta": None, "expires": None, "retries": 0, "timelimit": [None, None],
            "root_id": tid, "parent_id": None, "group": None, "ignore_result": False,
            "origin": "gen1@host", "argsrepr": "(...)", "kwargsrepr": "{...}",
            "callbacks": None, "errbacks": None, "chain": None, "chord": None,
            "custom_headers": {}, "compression": None, "reply_to": None, "correlation_id": tid,
        },
    }
    with open(os.path.join(OUT, doc["name"] + ".json"), "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
