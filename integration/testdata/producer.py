"""Send Celery tasks with real Celery (the rpc result backend) and print
their results as JSON, for the integration tests.

Run with the system Python that has Celery 5.2 (/usr/bin/python3):

    producer.py '<spec json>'

spec: {"broker": url, "queue": name, "timeout": seconds,
       "calls": [{"task": name, "args": [...], "kwargs": {...},
                  "task_id": id (optional: the same id may be sent again)}]}

Prints {"results": [...]}: for each distinct task id, in order of first
send, {"id", "ok": result} or {"id", "exc_type", "message"}.
"""
import json
import sys

from celery import Celery


def main():
    spec = json.loads(sys.argv[1])
    app = Celery("onceler_producer", broker=spec["broker"], backend="rpc://")
    app.conf.task_default_queue = spec["queue"]
    app.conf.result_accept_content = ["json"]
    sent, seen = [], set()
    for c in spec["calls"]:
        opts = {"queue": spec["queue"]}
        if c.get("task_id"):
            opts["task_id"] = c["task_id"]
        r = app.send_task(c["task"], args=c.get("args", []), kwargs=c.get("kwargs", {}), **opts)
        if r.id not in seen:
            seen.add(r.id)
            sent.append(r)
    out = []
    for r in sent:
        try:
            out.append({"id": r.id, "ok": r.get(timeout=spec.get("timeout", 60))})
        except Exception as e:
            out.append({"id": r.id, "exc_type": type(e).__name__, "message": str(e)})
    print(json.dumps({"results": out}))


if __name__ == "__main__":
    main()
