"""The Python side of the throughput benchmark: a Celery 5.2.6 app whose task
bench.outside does what onceler's outside-mode record does for one delivery,
with psycopg2: claim the operation (INSERT ... ON CONFLICT DO NOTHING,
committed), then record the completion (UPDATE, committed).

The bench command starts it as

    /usr/bin/python3 -m celery -A celery_worker worker --concurrency 2 \
        --pool prefork -Q <queue> --without-gossip --without-mingle \
        --without-heartbeat -O fair

with BENCH_BROKER_URL, BENCH_DSN and BENCH_SCHEMA in the environment.
"""
import os
import uuid

import psycopg2
from celery import Celery

app = Celery("onceler_bench", broker=os.environ["BENCH_BROKER_URL"])
app.conf.update(
    task_acks_late=True,
    worker_prefetch_multiplier=int(os.environ.get("BENCH_PREFETCH_MULTIPLIER", "16")),
    task_ignore_result=True,
    accept_content=["json"],
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)

SCHEMA = os.environ["BENCH_SCHEMA"]
_conn = None


def conn():
    """One connection per prefork child, opened on first use."""
    global _conn
    if _conn is None or _conn.closed:
        _conn = psycopg2.connect(os.environ["BENCH_DSN"], application_name="onceler-bench-python")
    return _conn


@app.task(name="bench.outside", acks_late=True, ignore_result=True)
def outside(op):
    c = conn()
    token = uuid.uuid4().hex
    with c.cursor() as cur:
        cur.execute(
            f"INSERT INTO {SCHEMA}.py_records (task, key, status, token, claimed_at)"
            " VALUES (%s, %s, 'claimed', %s, clock_timestamp()) ON CONFLICT DO NOTHING",
            ("bench.outside", op, token),
        )
        claimed = cur.rowcount == 1
    c.commit()
    if not claimed:
        return None
    # the outside effect would happen here (a no-op in the benchmark)
    with c.cursor() as cur:
        cur.execute(
            f"UPDATE {SCHEMA}.py_records SET status = 'completed', completed_at = clock_timestamp()"
            " WHERE task = %s AND key = %s AND token = %s",
            ("bench.outside", op, token),
        )
    c.commit()
    return None
