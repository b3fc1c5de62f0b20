"""Celery app for the control tests: a producer/caller of Go tasks.

Configured from the environment: ONCELER_BROKER (broker URL), ONCELER_QUEUE
(the Go worker's task queue). The tasks are declared here only so that
Python can call them by name; the Go worker runs them.
"""
import os

from celery import Celery

app = Celery('onceler_control_test',
             broker=os.environ['ONCELER_BROKER'],
             backend='rpc://')
app.conf.task_default_queue = os.environ['ONCELER_QUEUE']
app.conf.accept_content = ['json']
app.conf.result_accept_content = ['json']


@app.task(name='demo.sleep')
def sleep(*args, **kwargs):
    raise RuntimeError('runs in the Go worker')


@app.task(name='demo.add')
def add(x, y):
    raise RuntimeError('runs in the Go worker')


if os.environ.get('ONCELER_PY_REVOKE_EXPIRES'):
    # A Python worker of a mixed fleet whose revoked ids expire soon
    # (Celery 5.2.6 has no setting for it: worker_state.REVOKE_EXPIRES).
    from celery.worker import state as worker_state
    worker_state.revoked.expires = float(os.environ['ONCELER_PY_REVOKE_EXPIRES'])
