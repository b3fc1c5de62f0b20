"""Sends mingle's hello to NODE as another worker would and prints the
revoked ids of its reply (a Celery worker purges the expired ones first).

    hello.py NODE
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from app import app  # noqa: E402

node = sys.argv[1]
reply = (app.control.inspect([node], timeout=5).hello('probe@onceler-test', None) or {}).get(node) or {}
print(json.dumps({'revoked': reply.get('revoked')}))
