#!/usr/bin/env python3
"""Sends onceler's demo tasks from Python Celery and prints every result.

Run it with the system Python that has Celery (/usr/bin/python3) while
`onceler worker --migrate` runs:

    /usr/bin/python3 scripts/walkthrough.py          # the walkthrough
    /usr/bin/python3 scripts/walkthrough.py crash    # the crash demonstration

Every operation with a side effect is sent three times with the same
operation key, as an at-least-once producer or a retrying client would do; the
worker runs it once and answers the copies with the stored result. At the end the script counts,
in the demo tables, how often each effect really happened.

Environment: ONCELER_BROKER_URL (default amqp://guest:guest@localhost:5672//)
and ONCELER_DATABASE_URL (default: the libpq environment), as for the worker.
"""
import argparse
import json
import os
import re
import sys
import time

from celery import Celery
import psycopg2


def libpq_dsn(dsn):
    """dsn without the parameters only the worker's driver (pgx) knows
    (pool_max_conns and the other pool_* settings), which libpq refuses."""
    if "://" in dsn:
        base, _, query = dsn.partition("?")
        kept = [p for p in query.split("&") if p and not p.startswith("pool_")]
        return base + ("?" + "&".join(kept) if kept else "")
    return re.sub(r"(^|\s)pool_\w+\s*=\s*\S+", "", dsn).strip()


TIMEOUT = 60.0
CRASH_TIMEOUT = 300.0


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", nargs="?", default="walkthrough", choices=["walkthrough", "crash"],
                   help="what to run (default: walkthrough)")
    p.add_argument("--queue", default="celery", help="queue the worker consumes (default: celery)")
    p.add_argument("--prefix", default="",
                   help="prefix for every operation key, to keep runs apart (not printed)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds to wait for each result (default: 60; crash: 300, time to restart the worker)")
    opts = p.parse_args()
    if opts.timeout is None:
        opts.timeout = CRASH_TIMEOUT if opts.part == "crash" else TIMEOUT
    return opts


class Walk:
    def __init__(self, opts):
        self.opts = opts
        broker = os.environ.get("ONCELER_BROKER_URL", "amqp://guest:guest@localhost:5672//")
        self.app = Celery("walkthrough", broker=broker, backend="rpc://")
        self.app.conf.task_serializer = "json"
        self.app.conf.accept_content = ["json"]
        self.app.conf.result_accept_content = ["json"]
        self.db = psycopg2.connect(libpq_dsn(os.environ.get("ONCELER_DATABASE_URL", "")))
        self.db.autocommit = True

    def k(self, key):
        """The operation key as sent: the run's prefix and the shown key."""
        return self.opts.prefix + key

    def show(self, value):
        """A result as printed: JSON with sorted keys, without the prefix."""
        text = json.dumps(value, sort_keys=True)
        if self.opts.prefix:
            text = text.replace(self.opts.prefix, "")
        return text

    def send(self, name, *args):
        return self.app.send_task(name, args=list(args), queue=self.opts.queue)

    def wait(self, res):
        try:
            return self.show(res.get(timeout=self.opts.timeout, propagate=True, disable_sync_subtasks=False))
        except Exception as exc:  # the task's own error, as Celery raises it
            return "%s: %s" % (type(exc).__name__, exc)

    def call(self, label, name, *args):
        print("%-44s -> %s" % (label, self.wait(self.send(name, *args))), flush=True)

    def thrice(self, label, name, *args):
        """Sends the same operation three times, as a retrying producer would:
        once, then twice more at the same time, and prints each answer."""
        first = self.send(name, *args)
        print("%-44s -> %s" % (label + " #1", self.wait(first)), flush=True)
        again = [self.send(name, *args) for _ in range(2)]
        for i, res in enumerate(again, 2):
            print("%-44s -> %s" % ("%s #%d" % (label, i), self.wait(res)), flush=True)

    def count(self, sql, key):
        with self.db.cursor() as cur:
            cur.execute(sql, (self.k(key),))
            return cur.fetchone()[0]

    def effects(self, what):
        queries = {
            "ledger rows for e-1": ("SELECT count(*) FROM onceler_demo.ledger WHERE entry_id = %s", "e-1"),
            "gateway calls for order-1": ("SELECT count(*) FROM onceler_demo.gateway_calls WHERE order_id = %s", "order-1"),
            "gateway charges for order-1": ("SELECT count(*) FROM onceler_demo.gateway_charges WHERE order_id = %s", "order-1"),
            "emails sent for msg-1": ("SELECT count(*) FROM onceler_demo.email_sends WHERE message_id = %s", "msg-1"),
            "gateway calls for order-2": ("SELECT count(*) FROM onceler_demo.gateway_calls WHERE order_id = %s", "order-2"),
            "gateway charges for order-2": ("SELECT count(*) FROM onceler_demo.gateway_charges WHERE order_id = %s", "order-2"),
        }
        print("effects:", flush=True)
        for name in what:
            sql, key = queries[name]
            print("  %-34s %d" % (name, self.count(sql, key)), flush=True)

    def walkthrough(self):
        self.call("demo.add(2, 3)", "demo.add", 2, 3)
        self.thrice("demo.ledger.credit(acct-1, e-1, 1500)", "demo.ledger.credit", self.k("acct-1"), self.k("e-1"), 1500)
        self.call("demo.ledger.credit(acct-1, e-2, 250)", "demo.ledger.credit", self.k("acct-1"), self.k("e-2"), 250)
        self.thrice("demo.payments.charge(order-1, 4200)", "demo.payments.charge", self.k("order-1"), 4200)
        self.thrice("demo.email.send(msg-1, ...)", "demo.email.send", self.k("msg-1"), "ann@example.com", "Your receipt")
        self.call("demo.flaky(op-1, failures=2)", "demo.flaky", self.k("op-1"), 2)
        self.call("demo.fail('bad input')", "demo.fail", "bad input")
        self.effects(["ledger rows for e-1", "gateway calls for order-1", "gateway charges for order-1",
                      "emails sent for msg-1"])

    def crash(self):
        print("sent demo.payments.charge(order-2, 990); waiting for its result", flush=True)
        res = self.send("demo.payments.charge", self.k("order-2"), 990)
        print("%-44s -> %s" % ("demo.payments.charge(order-2, 990)", self.wait(res)), flush=True)
        self.effects(["gateway calls for order-2", "gateway charges for order-2"])


def consumers(app, queue):
    """The consumers of queue, by a passive declare (0: no such queue)."""
    with app.connection_for_write() as conn:
        try:
            _, _, count = conn.default_channel.queue_declare(queue=queue, passive=True)
        except conn.channel_errors:
            return 0
        return count


def require_worker(app, queue, wait=5.0):
    """Exits at once, in one line, when no worker consumes queue: the results
    would never come."""
    deadline = time.monotonic() + wait
    while consumers(app, queue) == 0:
        if time.monotonic() >= deadline:
            sys.exit("walkthrough: no worker is consuming queue %s: start 'onceler worker --migrate' "
                     "(with the same ONCELER_BROKER_URL and --queues) first" % queue)
        time.sleep(0.5)


def main():
    opts = parse_args()
    w = Walk(opts)
    require_worker(w.app, opts.queue)
    try:
        getattr(w, opts.part)()
    finally:
        w.db.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
