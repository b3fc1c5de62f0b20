"""Celery workflows over onceler workers, with a Python task beside them.

The same module is the Celery app of the Python worker the tests start:

    /usr/bin/python3 -m celery -A wf worker -Q <py queue> --pool solo ...

and, run as a script, the client:

    wf.py scenario [scenario ...]

Environment: ONCELER_WF_BROKER (broker URL), ONCELER_WF_GOQ (queue of the
Go tasks t.*), ONCELER_WF_PYQ (queue of the Python task py.mul),
ONCELER_WF_BACKEND (result backend URL, default rpc://; "django-db" with
DJANGO_SETTINGS_MODULE naming the Django settings).

A scenario may also be a JSON call spec (see call): {"name", "task", "args",
"kwargs", "options", "ready_at"}.

Prints one JSON object: {scenario: {"ok": value} or {"exc_type",
"exc_module", "message"}}.
"""
import json
import os
import sys
import time

from celery import Celery, chain, chord, group

if os.environ.get("DJANGO_SETTINGS_MODULE"):
    import django

    django.setup()

GOQ = os.environ["ONCELER_WF_GOQ"]
PYQ = os.environ["ONCELER_WF_PYQ"]

app = Celery("wf", broker=os.environ["ONCELER_WF_BROKER"], backend=os.environ.get("ONCELER_WF_BACKEND") or "rpc://")
app.conf.task_default_queue = GOQ
app.conf.task_routes = {"py.*": {"queue": PYQ}, "t.*": {"queue": GOQ}}
app.conf.accept_content = ["json", "msgpack"]
app.conf.result_accept_content = ["json"]
app.conf.worker_hijack_root_logger = False


@app.task(name="py.mul")
def mul(x, y):
    return x * y


@app.task(name="py.xsum")
def xsum(numbers):
    return sum(numbers)


@app.task(name="py.kind")
def kind(x, b):
    """x, and what b arrived as: its type's name and, for bytes, its values."""
    return [x, type(b).__name__, list(b) if isinstance(b, bytes) else b]


def s(name, *args, **kwargs):
    return app.signature(name, args=args, kwargs=kwargs)


TIMEOUT = 30


def run(name):
    if name == "chain_go":
        return chain(s("t.add", 1, 2), s("t.add", 10), s("t.add", 100)).apply_async().get(timeout=TIMEOUT)
    if name == "chain_mixed":
        # add(1, 2) = 3 in Go, mul(3, 10) = 30 in Python, add(30, 100) = 130 in Go
        return chain(s("t.add", 1, 2), s("py.mul", 10), s("t.add", 100)).apply_async().get(timeout=TIMEOUT)
    if name == "chain_msgpack_bytes":
        # add(1, 2) = 3 in Go, whose worker sends kind(3, b"\x00\xff") on in
        # msgpack, as the chain came: the bytes stay bytes.
        return chain(s("t.add", 1, 2), s("py.kind", b"\x00\xff")).apply_async(serializer="msgpack").get(timeout=TIMEOUT)
    if name == "chain_py_first":
        # mul(2, 3) = 6 in Python, whose worker publishes add(6, 4) = 10 to Go
        return chain(s("py.mul", 2, 3), s("t.add", 4)).apply_async().get(timeout=TIMEOUT)
    if name == "chain_group":
        # add(1, 2) = 3, then a group of add(3, 10) and add(3, 20)
        return chain(s("t.add", 1, 2), group(s("t.add", 10), s("t.add", 20))).apply_async().get(timeout=TIMEOUT)
    if name == "chain_group_fail":
        return chain(s("t.fail", 1, "group never runs"), group(s("t.add", 10), s("t.add", 20))).apply_async().get(timeout=TIMEOUT)
    if name == "link_group":
        r = app.send_task("t.add", args=(2, 2), link=group(s("t.record", "group-a"), s("t.record", "group-b")))
        return r.get(timeout=TIMEOUT)
    if name == "chain_immutable":
        return chain(s("t.add", 1, 2), app.signature("t.add", args=(5, 5), immutable=True)).apply_async().get(timeout=TIMEOUT)
    if name == "chain_bad_args":
        # t.add(1, 2, 3): TypeError before it runs, carried along the chain
        return chain(s("t.add", 1, 2, 3), s("t.add", 100)).apply_async().get(timeout=TIMEOUT)
    if name == "chain_fail":
        return chain(s("t.add", 1, 2), s("t.fail", "boom"), s("t.add", 100)).apply_async().get(timeout=TIMEOUT)
    if name == "link":
        r = app.send_task("t.add", args=(1, 2), link=s("t.record", "callback"))
        return {"id": r.id, "result": r.get(timeout=TIMEOUT)}
    if name == "link_error":
        r = app.send_task("t.fail", args=(7, "errback please"), link_error=s("t.record", "errback"))
        try:
            r.get(timeout=TIMEOUT)
        except Exception as e:
            return {"id": r.id, "exc_type": type(e).__name__}
        return {"id": r.id, "exc_type": None}
    if name == "group":
        return group(s("t.add", 1, 1), s("t.add", 2, 2), s("py.mul", 3, 3)).apply_async().get(timeout=TIMEOUT)
    if name == "chord":
        return chord([s("t.add", 1, 1)], s("t.add", 0)).apply_async().get(timeout=TIMEOUT)
    if name == "chord2":
        return chord([s("t.add", 1, 1), s("t.add", 2, 2)], s("t.add", 0)).apply_async().get(timeout=TIMEOUT)
    if name == "chord_go_body":
        # add(i, i) for i in 1..5 in Go, joined by the Go worker that ends
        # the header, summed by t.xsum in Go: 30
        return chord([s("t.add", i, i) for i in range(1, 6)], s("t.xsum")).apply_async().get(timeout=TIMEOUT)
    if name == "chord_py_body":
        # add(1, 1), add(2, 2), add(3, 3) in Go, summed by py.xsum in Python: 12
        return chord([s("t.add", i, i) for i in range(1, 4)], s("py.xsum")).apply_async().get(timeout=TIMEOUT)
    if name == "chord_msgpack":
        # parts sent in msgpack; the Go worker sends the Python body
        # kind([2], b"\x00\xff") on in msgpack too: the bytes stay bytes
        return chord([s("t.add", 1, 1)], s("py.kind", b"\x00\xff")).apply_async(serializer="msgpack").get(timeout=TIMEOUT)
    if name == "chord_fail":
        body = s("t.xsum")
        body.link_error(s("t.record", "chord-errback"))
        r = chord([s("t.add", 1, 1), s("t.fail", 0, "part boom")], body).apply_async()
        try:
            r.get(timeout=TIMEOUT)  # raises the header's error, as Celery's get() does
        except Exception as e:
            header = type(e).__name__
        # the body's own result, as the backend stores it
        deadline = time.monotonic() + TIMEOUT
        meta = app.backend.get_task_meta(r.id)
        while meta["status"] != "FAILURE" and time.monotonic() < deadline:
            time.sleep(0.1)
            meta = app.backend.get_task_meta(r.id)
        e = app.backend.exception_to_python(meta["result"])
        return {"id": r.id, "header_exc_type": header, "exc_type": type(e).__name__,
                "exc_module": type(e).__module__, "message": str(e.args[0]) if e.args else str(e)}
    if name == "chord_gate":
        # five chords of two t.gate parts each, which finish together on
        # two workers; each body t.record runs once
        rs = [chord([s("t.gate", "g%d" % i), s("t.gate", "g%d" % i)], s("t.record", "chord-gate")).apply_async()
              for i in range(5)]
        for r in rs:
            r.get(timeout=TIMEOUT)
        return [r.id for r in rs]
    if name == "eta_flood":
        # 40 tasks with a countdown, then 10 immediate ones behind them.
        start = time.monotonic()
        held = [app.send_task("t.add", args=(i, 0), countdown=5) for i in range(40)]
        time.sleep(1)
        sent = time.monotonic()
        quick = [app.send_task("t.add", args=(i, 1)) for i in range(10)]
        quick_results = [r.get(timeout=TIMEOUT) for r in quick]
        quick_seconds = time.monotonic() - sent
        held_results = [r.get(timeout=TIMEOUT) for r in held]
        return {"quick": quick_results, "quick_seconds": quick_seconds,
                "held": held_results, "held_seconds": time.monotonic() - start}
    raise ValueError("unknown scenario " + name)


def call(spec):
    """A single task call: {"task", "args", "kwargs", "options", "ready_at"}.

    Returns {"result", "elapsed"} (seconds from sending to the result) and,
    with ready_at, "ready_early": whether the result was ready ready_at
    seconds after sending.
    """
    start = time.monotonic()
    r = app.send_task(spec["task"], args=spec.get("args", []), kwargs=spec.get("kwargs", {}),
                      **spec.get("options", {}))
    out = {"id": r.id}
    if spec.get("ready_at"):
        time.sleep(max(0, spec["ready_at"] - (time.monotonic() - start)))
        out["ready_early"] = r.ready()
    try:
        out["result"] = r.get(timeout=TIMEOUT)
    except Exception as e:  # report the class the client built
        out.update({"exc_type": type(e).__name__, "exc_module": type(e).__module__,
                    "message": str(e.args[0]) if e.args else str(e)})
    out["elapsed"] = time.monotonic() - start
    return out


def main():
    out = {}
    for name in sys.argv[1:]:
        if name.startswith("{"):
            spec = json.loads(name)
            out[spec["name"]] = {"ok": call(spec)}
            continue
        try:
            out[name] = {"ok": run(name)}
        except Exception as e:  # report the class the client built
            out[name] = {"exc_type": type(e).__name__, "exc_module": type(e).__module__,
                         "message": str(e.args[0]) if e.args else str(e)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
