"""Decode Go-encoded task messages and rpc results with real Celery/kombu.

Reads {"tasks": [...], "results": [...]} as JSON on stdin (bodies base64)
and prints what Celery found, as JSON, for the Go test to assert.
Run by TestRoundTripPython with /usr/bin/python3.
"""
import base64
import json
import sys

from celery import Celery
from celery.worker.request import Request
from celery.worker.strategy import proto1_to_proto2
from kombu.message import Message

app = Celery("roundtrip", broker="memory://", backend="rpc://")
ACCEPT = {"application/json", "application/x-msgpack", "application/x-yaml"}


@app.task(name="tasks.add")
def add(x, y, **kw):
    return x + y


def task_out(p):
    headers = p.get("headers") or {}
    msg = Message(body=base64.b64decode(p["body"]), content_type=p["content_type"],
                  content_encoding=p["content_encoding"], headers=headers,
                  properties={"correlation_id": p.get("correlation_id"), "reply_to": p.get("reply_to"),
                              "delivery_mode": p.get("delivery_mode"), "priority": p.get("priority")},
                  accept=ACCEPT, delivery_info={"exchange": "", "routing_key": "q"})
    if "task" in headers:  # protocol 2, as the worker's default strategy reads it
        req = Request(msg, app=app, task=app.tasks[headers["task"]])
        protocol = 2
    else:
        body, hdrs, decoded, utc = proto1_to_proto2(msg, msg.decode())
        req = Request(msg, app=app, task=app.tasks[hdrs["task"]], body=body, headers=hdrs,
                      decoded=decoded, utc=utc)
        protocol = 1
    args, kwargs, embed = req._payload if protocol == 2 else req._body
    return {
        "protocol": protocol, "name": req.task_name, "id": req.id, "args": list(args), "kwargs": kwargs,
        "eta": req.eta.isoformat() if req.eta else None,
        "expires": req.expires.isoformat() if req.expires else None,
        "time_limits": list(req.time_limits), "retries": req.request_dict.get("retries"),
        "root_id": req.root_id, "parent_id": req.parent_id, "reply_to": req.reply_to,
        "correlation_id": req.correlation_id,
        "callbacks": [s["task"] for s in (embed.get("callbacks") or [])],
        "chain": [s["task"] for s in (embed.get("chain") or [])],
        "idempotency_key": req.request_dict.get("idempotency_key"),
    }


def result_out(p):
    from kombu.serialization import loads
    meta = loads(base64.b64decode(p["body"]), p["content_type"], p["content_encoding"], accept=ACCEPT)
    r = app.AsyncResult(meta["task_id"])
    r._maybe_set_cache(meta)  # the rpc backend's path: meta_from_decoded + cache
    out = {"task_id": r.id, "correlation_id": p.get("correlation_id"), "state": r.state,
           "delivery_mode": p.get("delivery_mode")}
    try:
        out["value"] = r.get(timeout=1, propagate=True, disable_sync_subtasks=False)
    except BaseException as exc:  # noqa: the point is to see what Celery raises
        out["raised"] = {"module": type(exc).__module__, "type": type(exc).__name__,
                         "str": str(exc), "args": [str(a) for a in exc.args],
                         "is_exception": isinstance(exc, Exception)}
    return out


def main():
    req = json.load(sys.stdin)
    print(json.dumps({"tasks": [task_out(p) for p in req["tasks"]],
                      "results": [result_out(p) for p in req["results"]]}))


if __name__ == "__main__":
    main()
