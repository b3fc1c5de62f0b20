#!/usr/bin/env python3
"""Sends billing.refund from Python Celery and prints its result.

    /usr/bin/python3 call.py ORDER_ID CENTS

The broker is ONCELER_BROKER_URL (default amqp://guest:guest@localhost:5672//),
as for the worker; results come back through the rpc:// backend.
"""
import argparse
import json
import os

from celery import Celery

p = argparse.ArgumentParser(description="Sends billing.refund and prints its result.")
p.add_argument("order_id")
p.add_argument("cents", type=int)
p.add_argument("--queue", default="celery", help="queue the worker consumes (default: celery)")
opts = p.parse_args()

app = Celery("shop", broker=os.environ.get("ONCELER_BROKER_URL", "amqp://guest:guest@localhost:5672//"),
             backend="rpc://")
result = app.send_task("billing.refund", args=[opts.order_id, opts.cents], queue=opts.queue)
print(f"billing.refund({opts.order_id}, {opts.cents}) -> {json.dumps(result.get(timeout=60), sort_keys=True)}")
