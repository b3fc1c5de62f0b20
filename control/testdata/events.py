"""Watches a Go worker through celery.events, as `celery events` and Flower do.

    events.py NODE

Declares its event queue and prints "ready"; then, on the node's first event
(other workers on the broker send events too, and the node's mailbox is bound
only once it sends), turns task events on with enable_events, runs
demo.add(2, 3) and waits until
celery.events.State has its full sequence and a few heartbeats; then turns
task events off, runs demo.add(4, 5) and listens a little longer. Prints one
JSON summary.
"""
import json
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from app import app, add  # noqa: E402

node = sys.argv[1]
state = app.events.State()
seen = []  # (type, uuid) of this node's events, in arrival order


def on_event(event):
    if event.get('hostname') == node:
        seen.append((event['type'], event.get('uuid')))
    state.event(event)


out = {}
with app.connection_for_read() as conn:
    recv = app.events.Receiver(conn, handlers={'*': on_event})
    recv.queue.bind(conn.default_channel).declare()
    print('ready', flush=True)
    first = second = None
    t_end = None
    deadline = time.time() + 40
    try:
        for _ in recv.itercapture(limit=None, timeout=10, wakeup=False):
            if time.time() > deadline:
                break
            if first is None:
                if not seen:
                    continue
                out['enable'] = app.control.enable_events(destination=[node], reply=True)
                first = add.apply_async((2, 3))
                out['first_value'] = first.get(timeout=15)
            task = state.tasks.get(first.id)
            beats = sum(1 for t, _ in seen if t == 'worker-heartbeat')
            if second is None and task is not None and task.state == 'SUCCESS' and beats >= 2:
                w = state.workers.get(node)
                out['alive'] = [x.hostname for x in state.alive_workers()]
                out['worker'] = {'alive': w.alive, 'freq': w.freq, 'sw_ident': w.sw_ident,
                                 'processed': w.processed, 'loadavg': w.loadavg}
                out['task'] = {'state': task.state, 'name': task.name, 'args': task.args,
                               'result': task.result, 'runtime': task.runtime,
                               'worker': task.worker.hostname if task.worker else None,
                               'received': task.received, 'started': task.started,
                               'succeeded': task.succeeded}
                out['disable'] = app.control.disable_events(destination=[node], reply=True)
                second = add.apply_async((4, 5))
                out['second_value'] = second.get(timeout=15)
                t_end = time.time() + 2.5
            if t_end is not None and time.time() > t_end:
                break
    except socket.timeout:
        out['timeout'] = True
    out['seen'] = seen
    out['first_id'] = first and first.id
    out['second_id'] = second and second.id
print(json.dumps(out, default=str), flush=True)
