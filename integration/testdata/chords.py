"""Send Celery chords of demo.add parts with a demo.xsum body, with real
Celery and the Redis result backend, for the integration tests.

Run with the system Python that has Celery 5.2 (/usr/bin/python3):

    chords.py '<spec json>'

spec: {"broker": url, "backend": redis URL, "queue": the parts' queue,
       "body_queue": the bodies' queue, "chords": n, "parts": k}

Chord i has the parts demo.add(i, j) for j in 0..k-1, so its body gets
the list of their results and sums it to k*i + k*(k-1)/2. Prints
{"bodies": {body task id: expected sum}} once every chord is sent.
"""
import json
import sys

from celery import Celery, chord


def main():
    spec = json.loads(sys.argv[1])
    app = Celery("onceler_chords", broker=spec["broker"], backend=spec["backend"])
    app.conf.task_default_queue = spec["queue"]
    app.conf.result_accept_content = ["json"]
    k = spec["parts"]
    bodies = {}
    for i in range(spec["chords"]):
        header = [app.signature("demo.add", args=(i, j), queue=spec["queue"]) for j in range(k)]
        body = app.signature("demo.xsum", queue=spec["body_queue"])
        r = chord(header, body).apply_async()
        bodies[r.id] = k * i + k * (k - 1) // 2
    print(json.dumps({"bodies": bodies}))


if __name__ == "__main__":
    main()
