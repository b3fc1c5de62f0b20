"""Real Celery with django-celery-results (CELERY_RESULT_BACKEND "django-db").

DJANGO_SETTINGS_MODULE names the test's Django settings (on PYTHONPATH).
With argv[1] a client.py spec (its "backend" is "django-db"), it sends the
calls as client.py does. With argv[1] == "store" and argv[2] a JSON list of
[task_id, status, result] (result for FAILURE: [exc_type, message]), it
stores them with django-celery-results' own DatabaseBackend, as a Python
worker would, to compare its rows with onceler's.
"""
import json
import os
import sys

import django

django.setup()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if sys.argv[1] == "store":
    import builtins

    from celery import Celery
    from celery.app.task import Context

    app = Celery("onceler_django_store", backend="django-db")
    for task_id, status, result in json.loads(sys.argv[2]):
        if status == "FAILURE":
            result = getattr(builtins, result[0])(result[1])
        # The request of a task without children, as a worker passes it.
        app.backend.store_result(task_id, result, status, traceback="Traceback (most recent call last):\n",
                                 request=Context(id=task_id, children=[]))
    print(json.dumps({"stored": True}))
else:
    import client

    client.main()
