"""Send Celery tasks to a onceler worker and print their results as JSON.

Run with the system Python that has Celery 5.2 (/usr/bin/python3):

    client.py '<spec json>'

spec: {"broker": url, "queue": name, "protocol": 1|2, "timeout": seconds,
       "backend": result backend URL (default "rpc://"),
       "announce_sent": bool (print SENT to stderr once every call is sent),
       "retry_connection_errors": bool (a get() that raises ConnectionError
       is asked again until the timeout),
       "serializer": "json"|"msgpack"|"yaml",
       "accept": [...], "result_accept": [...] (accept_content and
       result_accept_content; default all three, and json),
       "calls": [{"task": name, "args": [...], "kwargs": {...},
                  "headers": {...}, "ignore_result": bool,
                  "after_previous": bool,
                  "options": {apply_async options}}
                 or {"group": [calls], "after_previous": bool}]}

A call with "after_previous" is sent only once the results of every call
before it have arrived (ordering a test's messages). A "group" call sends
its calls as one Celery group and waits for GroupResult.get(). A call with
"ignore_result" is sent with that option and its result is then waited for
through a new AsyncResult of its id (the one send_task returns gives None
at once), to see what the worker still reports: only a failure or a retry.

Prints one JSON object: {"results": [...]} with, for each call in order,
{"id": task id, "ok": result} or {"id", "exc_type", "exc_module", "message"}.
"""
import json
import sys
import time

from celery import Celery, group


def main():
    spec = json.loads(sys.argv[1])
    app = Celery("onceler_client", broker=spec["broker"], backend=spec.get("backend", "rpc://"))
    app.conf.task_default_queue = spec["queue"]
    app.conf.task_protocol = spec.get("protocol", 2)
    ser = spec.get("serializer", "json")
    app.conf.task_serializer = ser
    app.conf.accept_content = spec.get("accept", ["json", "msgpack", "yaml"])
    app.conf.result_accept_content = spec.get("result_accept", ["json"])
    timeout = spec.get("timeout", 30)

    sent = []
    out = []

    def get(r):
        # With "retry_connection_errors", a get() that meets the result
        # backend down (Celery 5.2's Redis get() raises ConnectionError
        # then) is asked again, as an application would, until timeout.
        deadline = time.monotonic() + timeout
        while True:
            try:
                return r.get(timeout=timeout)
            except Exception as e:
                if not spec.get("retry_connection_errors") or type(e).__name__ != "ConnectionError" \
                        or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def collect():
        for r in sent[len(out):]:
            if getattr(r, "ignored", False):
                r = app.AsyncResult(r.id)
            try:
                out.append({"id": r.id, "ok": get(r)})
            except Exception as e:  # report the class the client built
                out.append({"id": r.id, "exc_type": type(e).__name__,
                            "exc_module": type(e).__module__,
                            "message": str(e.args[0]) if e.args else str(e),
                            "traceback": r.traceback})

    def options(c):
        opts = {"queue": spec["queue"]}
        if c.get("headers"):
            opts["headers"] = c["headers"]
        if c.get("ignore_result"):
            opts["ignore_result"] = True
        # countdown, expires, time_limit, soft_time_limit, ...
        opts.update(c.get("options") or {})
        return opts

    for c in spec["calls"]:
        if c.get("after_previous"):
            collect()
        if "group" in c:
            sigs = [app.signature(m["task"], args=m.get("args", []), kwargs=m.get("kwargs", {}),
                                  **options(m)) for m in c["group"]]
            sent.append(group(sigs).apply_async())
            continue
        sent.append(app.send_task(c["task"], args=c.get("args", []),
                                  kwargs=c.get("kwargs", {}), **options(c)))
    if spec.get("announce_sent"):
        print("SENT", file=sys.stderr, flush=True)
    collect()
    print(json.dumps({"results": out}))


if __name__ == "__main__":
    main()
