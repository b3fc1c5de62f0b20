"""Hostile inputs to the run-time remote commands of a Go worker serving
the demo tasks, printing one JSON line.

    edges.py NODE poolgrow    pool_grow by 2**63-1: the slots in stats after
    edges.py NODE nanargs     a demo.add(NaN, 1) held for its ETA: inspect
                              scheduled and reserved
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from app import add, app  # noqa: E402
from ops import one, slots  # noqa: E402


def finite(v):
    """v with NaN and infinities as their repr: the Go test reads this
    output with encoding/json, which has no NaN."""
    if isinstance(v, float) and v != v or v in (float('inf'), float('-inf')):
        return repr(v)
    if isinstance(v, dict):
        return {k: finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [finite(x) for x in v]
    return v


def main():
    node, mode = sys.argv[1], sys.argv[2]
    out = {}
    if mode == 'poolgrow':
        out['slots_before'] = slots(node)
        out['grow'] = one(node, app.control.pool_grow(2**63 - 1, destination=[node], reply=True))
        out['slots_after'] = slots(node)
    elif mode == 'nanargs':
        plain = add.apply_async((1, 2), countdown=30)
        nan = add.apply_async((float('nan'), 1), countdown=30)
        time.sleep(2)
        i = app.control.inspect([node], timeout=5)
        out['scheduled'] = (i.scheduled() or {}).get(node)
        out['ids'] = [plain.id, nan.id]
        app.control.revoke([plain.id, nan.id])
    print(json.dumps(finite(out)))


if __name__ == '__main__':
    main()
