"""Drives Celery's run-time remote commands against a Go worker serving the
demo tasks, as an operator would with app.control, printing one JSON line.

    ops.py NODE rate               rate_limit demo.sleep: its effect on
                                   demo.sleep and (none) on demo.add
    ops.py NODE time               time_limit demo.sleep 1 2: a long sleep fails
    ops.py NODE queues             add_consumer, then cancel_consumer, of a
                                   new queue: active_queues and tasks sent there
    ops.py NODE pool               pool_shrink, pool_grow, autoscale: the
                                   slots in stats and tasks running at once
    ops.py NODE fields             active (safe or not), reserved, stats'
                                   broker, conf with and without defaults
    ops.py NODE add                demo.add as Python adds
    ops.py NODE arrival            every slot busy, then 5 demo.add and a
                                   countdown one: task-received times (an
                                   event receiver), reserved, scheduled,
                                   query_task
"""
import json
import os
import socket
import sys
import threading
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from app import add, app, sleep  # noqa: E402


def one(node, replies):
    """This node's reply out of app.control's list of {node: reply}."""
    for r in replies or []:
        if node in r:
            return r[node]
    return None


def sleeps(n, seconds, **options):
    return [sleep.apply_async(kwargs={'op': str(uuid.uuid4()), 'seconds': seconds}, **options) for _ in range(n)]


def finish_times(results, t0, timeout=60):
    """Seconds from t0 at which each result was ready, in order."""
    done = {}
    deadline = time.time() + timeout
    while len(done) < len(results) and time.time() < deadline:
        for i, r in enumerate(results):
            if i not in done and r.ready():
                done[i] = time.time() - t0
        time.sleep(0.02)
    return sorted(done.values())


def pool_run(node, n, seconds):
    """Sends n demo.sleep(seconds) and waits for them, looking at inspect
    active meanwhile (one thread: kombu connections are not thread-safe)."""
    i = app.control.inspect([node], timeout=1)
    t0 = time.time()
    res = sleeps(n, seconds)
    peak, done = 0, {}
    deadline = time.time() + 60
    while len(done) < n and time.time() < deadline:
        a = (i.active() or {}).get(node) or []
        peak = max(peak, len(a))
        for k, r in enumerate(res):
            if k not in done and r.ready():
                done[k] = time.time() - t0
        time.sleep(0.02)
    times = sorted(done.values())
    return {'elapsed': times[-1] if len(times) == n else None, 'peak': peak, 'states': [r.state for r in res]}


def slots(node):
    stats = (app.control.inspect([node], timeout=5).stats() or {}).get(node) or {}
    return stats.get('pool', {}).get('max-concurrency')


def listen(node, received, ready, stop):
    """Records this node's task-received events: {uuid: [time, name, args]}."""
    def on(event):
        if event.get('hostname') == node:
            received[event['uuid']] = [time.time(), event.get('name'), event.get('args')]
    with app.connection_for_read() as conn:
        recv = app.events.Receiver(conn, handlers={'task-received': on})
        recv.queue.bind(conn.default_channel).declare()
        ready.set()
        while not stop.is_set():
            try:
                for _ in recv.itercapture(limit=None, timeout=0.5, wakeup=False):
                    if stop.is_set():
                        break
            except socket.timeout:
                pass


def arrival(node, out):
    received, ready, stop = {}, threading.Event(), threading.Event()
    th = threading.Thread(target=listen, args=(node, received, ready, stop), daemon=True)
    th.start()
    ready.wait(10)
    i = app.control.inspect([node], timeout=1)
    busy = sleeps(2, 3)
    deadline = time.time() + 20
    while time.time() < deadline and len((i.active() or {}).get(node) or []) < 2:
        time.sleep(0.05)
    out['active_before'] = len((i.active() or {}).get(node) or [])
    sent, res = {}, []
    for k in range(5):
        t = time.time()
        r = add.apply_async((k, 1000 + k))
        sent[r.id] = t
        res.append(r)
    later = add.apply_async((7, 8), countdown=60)
    time.sleep(0.5)
    out['reserved'] = (i.reserved() or {}).get(node)
    out['scheduled'] = (i.scheduled() or {}).get(node)
    out['query'] = (i.query_task(*[r.id for r in res]) or {}).get(node)
    out['values'] = [r.get(timeout=30) for r in res]
    out['busy_states'] = [r.state for r in busy]
    for r in busy:
        r.get(timeout=30)
    stop.set()
    th.join(5)
    out['sent'] = sent
    out['received'] = received
    out['later'] = later.id
    app.control.revoke(later.id)


def main():
    node, mode = sys.argv[1], sys.argv[2]
    out = {}
    if mode == 'rate':
        out['unknown'] = one(node, app.control.rate_limit('no.such.task', '1/s', destination=[node], reply=True))
        out['invalid'] = one(node, app.control.rate_limit('demo.sleep', 'x/s', destination=[node], reply=True))
        out['set'] = one(node, app.control.rate_limit('demo.sleep', '60/m', destination=[node], reply=True))
        t0 = time.time()
        slow = sleeps(4, 0)
        fast = [add.delay(i, 1) for i in range(4)]
        out['add_times'] = finish_times(fast, t0)
        out['sleep_times'] = finish_times(slow, t0)
        out['add_values'] = [r.get(timeout=10) for r in fast]
        out['off'] = one(node, app.control.rate_limit('demo.sleep', '0', destination=[node], reply=True))
        t0 = time.time()
        out['unlimited_times'] = finish_times(sleeps(4, 0), t0)
    elif mode == 'time':
        out['unknown'] = one(node, app.control.time_limit('no.such.task', soft=1, destination=[node], reply=True))
        out['set'] = one(node, app.control.time_limit('demo.sleep', soft=1, hard=2, destination=[node], reply=True))
        t0 = time.time()
        r = sleeps(1, 20)[0]
        try:
            out['value'] = r.get(timeout=30)
        except Exception as exc:  # noqa: BLE001 - reported to the Go test
            out['exc'] = type(exc).__name__
        out['elapsed'] = time.time() - t0
        out['state'] = r.state
        out['reset'] = one(node, app.control.time_limit('demo.sleep', destination=[node], reply=True))
        out['after_reset'] = sleeps(1, 1.5)[0].get(timeout=30)
    elif mode == 'queues':
        q = sys.argv[3]
        out['add'] = one(node, app.control.add_consumer(q, destination=[node], reply=True))
        out['queues_added'] = [x['name'] for x in (app.control.inspect([node], timeout=5).active_queues() or {}).get(node, [])]
        out['on_new_queue'] = add.apply_async((20, 22), queue=q).get(timeout=20)
        out['cancel'] = one(node, app.control.cancel_consumer(q, destination=[node], reply=True))
        out['queues_cancelled'] = [x['name'] for x in (app.control.inspect([node], timeout=5).active_queues() or {}).get(node, [])]
        r = add.apply_async((1, 1), queue=q)
        time.sleep(3)
        out['after_cancel_state'] = r.state
        with app.connection_for_write() as conn:
            ch = conn.default_channel
            out['left_in_queue'] = ch.queue_declare(q, passive=True).message_count
            ch.queue_delete(q)
            ch.queue_delete(q + '.quarantine')
            ch.exchange_delete(q)
    elif mode == 'pool':
        n, seconds = 6, 2
        out['slots_before'] = slots(node)
        out['shrink'] = one(node, app.control.pool_shrink(2, destination=[node], reply=True))
        out['slots_shrunk'] = slots(node)
        out['shrunk'] = pool_run(node, n, seconds)
        out['grow'] = one(node, app.control.pool_grow(1, destination=[node], reply=True))
        out['slots_grown'] = slots(node)
        out['autoscale'] = one(node, app.control.autoscale(6, 3, destination=[node], reply=True))
        out['slots_autoscaled'] = slots(node)
        out['grown'] = pool_run(node, n, seconds)
        out['restart'] = one(node, app.control.pool_restart(destination=[node], reply=True))
    elif mode == 'fields':
        r = sleep.apply_async(kwargs={'op': 'fields-' + str(uuid.uuid4()), 'seconds': 3})
        i = app.control.inspect([node], timeout=2)
        deadline = time.time() + 20
        while time.time() < deadline and not (i.active() or {}).get(node):
            time.sleep(0.1)
        out['active'] = (i.active() or {}).get(node)
        out['active_safe'] = (i.active(safe=True) or {}).get(node)
        out['query'] = (i.query_task(r.id) or {}).get(node)
        r.get(timeout=30)
        out['broker'] = ((i.stats() or {}).get(node) or {}).get('broker')
        out['conf'] = (i.conf() or {}).get(node)
        out['conf_defaults'] = (i.conf(with_defaults=True) or {}).get(node)
        out['report'] = (i.report() or {}).get(node)
        out['memsample'] = (i.memsample() or {}).get(node)
        out['memsample2'] = (i.memsample() or {}).get(node)
        out['memdump'] = (i.memdump() or {}).get(node)
        out['objgraph'] = (i.objgraph() or {}).get(node)
    elif mode == 'arrival':
        arrival(node, out)
    elif mode == 'add':
        for name, (x, y) in {'big': (10**17, 1), 'float': (1, 2.0), 'int': (2, 3), 'half': (0.5, 1)}.items():
            v = add.delay(x, y).get(timeout=20)
            out[name] = {'repr': repr(v), 'type': type(v).__name__}
    print(json.dumps(out))


if __name__ == '__main__':
    main()
