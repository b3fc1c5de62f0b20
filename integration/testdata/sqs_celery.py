"""A Celery 5.2.6 producer over SQS (kombu's SQS transport), for the SQS tests.

argv[1] is a JSON object: endpoint (the SQS server, http://host:port),
backend (the result backend URL, or null), queue (the SQS queue, Celery's
default queue), calls (a list of {task, args, kwargs, id, countdown, expires,
chain}), wait (seconds to wait for each result with get(); 0: do not wait),
visibility (the visibility timeout kombu creates the queue with).
Prints {"ids": [...], "results": [...]} as JSON.
"""
import json
import sys
from urllib.parse import urlparse

from celery import Celery, chain, signature

spec = json.loads(sys.argv[1])
u = urlparse(spec["endpoint"])
app = Celery("producer", broker="sqs://x:y@%s:%d" % (u.hostname, u.port), backend=spec.get("backend"))
app.conf.update(
    broker_transport_options={"region": "us-east-1", "visibility_timeout": spec.get("visibility", 30),
                              "wait_time_seconds": 0, "is_secure": False},
    task_default_queue=spec["queue"],
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    broker_connection_retry_on_startup=False,
)

results = []
for c in spec["calls"]:
    opts = {}
    for k in ("countdown", "expires"):
        if c.get(k) is not None:
            opts[k] = c[k]
    if c.get("id"):
        opts["task_id"] = c["id"]
    if c.get("chain"):
        sigs = [signature(s["task"], args=s.get("args", []), app=app) for s in c["chain"]]
        r = chain(*sigs).apply_async(**opts)
    else:
        r = app.send_task(c["task"], args=c.get("args", []), kwargs=c.get("kwargs", {}), **opts)
    results.append(r)

out = {"ids": [r.id for r in results], "results": []}
if spec.get("wait"):
    for r in results:
        try:
            out["results"].append({"status": "SUCCESS", "value": r.get(timeout=spec["wait"])})
        except Exception as e:  # noqa: BLE001 - reported to the test
            out["results"].append({"status": type(e).__name__, "value": str(e)})
print(json.dumps(out))
