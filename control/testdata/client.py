"""Drives a Go worker as a Python Celery client would, printing JSON.

    client.py NODE revoke-before SECONDS   revoke an id, then send demo.sleep with it
    client.py NODE terminate SECONDS MODE  send demo.sleep, wait until inspect
                                           active shows it, then terminate it
                                           (MODE cli: `celery control terminate`,
                                           api: app.control.revoke(terminate=True))
    client.py NODE call SECONDS            send demo.sleep and wait for it
    client.py NODE revoke-many COUNT       app.control.revoke of COUNT new ids
                                           with a reply, then a ping
"""
import json
import os
import subprocess
import sys
import time
import uuid

from celery.exceptions import TaskRevokedError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from app import app, sleep  # noqa: E402


def cli(*args):
    out = subprocess.run([sys.executable, '-m', 'celery', '-A', 'app'] + list(args),
                         cwd=os.path.dirname(os.path.abspath(__file__)),
                         capture_output=True, text=True, timeout=60)
    return {'rc': out.returncode, 'stdout': out.stdout, 'stderr': out.stderr[-2000:]}


def send_sleep(seconds, **options):
    """demo.sleep as the test worker takes it (seconds) or as the demo
    package does (kwargs op, seconds) when ONCELER_SLEEP_KWARGS is set."""
    if os.environ.get('ONCELER_SLEEP_KWARGS'):
        return sleep.apply_async(kwargs={'op': str(uuid.uuid4()), 'seconds': seconds}, **options)
    return sleep.apply_async((seconds,), **options)


def outcome(res, timeout):
    t0 = time.time()
    try:
        value = res.get(timeout=timeout)
        return {'state': res.state, 'value': value, 'elapsed': time.time() - t0}
    except TaskRevokedError as exc:
        return {'state': res.state, 'exc': type(exc).__name__, 'msg': str(exc), 'elapsed': time.time() - t0}
    except Exception as exc:  # noqa: BLE001 - reported to the Go test
        return {'state': res.state, 'exc': type(exc).__name__, 'msg': str(exc), 'elapsed': time.time() - t0}


def main():
    node, mode, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    if seconds.is_integer():
        seconds = int(seconds)
    out = {}
    if mode == 'revoke-before':
        task_id = str(uuid.uuid4())
        out['revoke'] = cli('control', 'revoke', task_id, '-d', node, '--json')
        res = send_sleep(seconds, task_id=task_id)
        out.update(outcome(res, 30))
    elif mode == 'terminate':
        res = send_sleep(seconds)
        seen = False
        deadline = time.time() + 20
        while time.time() < deadline and not seen:
            active = app.control.inspect([node], timeout=1).active() or {}
            seen = any(t['id'] == res.id for t in active.get(node, []))
            out['active'] = active.get(node)
        out['seen_active'] = seen
        if sys.argv[4] == 'cli':
            out['terminate'] = cli('control', 'terminate', 'SIGTERM', res.id, '-d', node, '--json')
        else:
            out['terminate'] = app.control.revoke(res.id, terminate=True, destination=[node], reply=True)
        out.update(outcome(res, 30))
    elif mode == 'revoke-many':
        ids = [str(uuid.uuid4()) for _ in range(int(seconds))]
        t0 = time.time()
        out['reply'] = app.control.revoke(ids, destination=[node], reply=True, timeout=10)
        out['elapsed'] = time.time() - t0
        out['ping'] = app.control.ping([node], timeout=5)
    elif mode == 'call':
        res = send_sleep(seconds)
        out.update(outcome(res, 30))
    print(json.dumps(out))


if __name__ == '__main__':
    main()
