"""lb/process/gctune.py: start-up's objects frozen out of the collector's way, start-up's garbage collected
first, and a reload handing the frozen objects back so cycles among replaced ones are freed.

Each check runs in a fresh interpreter: freezing this test process would take every object the test
session holds out of its collector.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROGRAM = """
import gc, weakref
gc.disable()                      # no automatic collection may blur what freeze/refreeze do
from lb.process import gctune

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)

garbage = cycle()                 # unreachable before the freeze: must be collected, not frozen
kept = Node(); kept.self = kept   # reachable at the freeze, dropped after it
kept_ref = weakref.ref(kept)
frozen = gctune.freeze_startup()
print("frozen", frozen)
print("garbage collected before the freeze", garbage() is None)
del kept
gc.collect()
print("dropped frozen cycle alive after a collection", kept_ref() is not None)
gctune.refreeze()
print("dropped frozen cycle alive after refreeze", kept_ref() is not None)
print("frozen after refreeze", gc.get_freeze_count() > 0)
"""


def run(env_extra: dict | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "EDGE_GC_FREEZE"} | (env_extra or {})
    p = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return {line.rsplit(" ", 1)[0]: line.rsplit(" ", 1)[1] for line in p.stdout.splitlines()}


def test_start_up_objects_are_frozen_after_its_garbage_is_collected():
    out = run()
    assert int(out["frozen"]) > 1000  # the interpreter's own modules and objects at least
    assert out["garbage collected before the freeze"] == "True"
    assert out["dropped frozen cycle alive after a collection"] == "True"  # what freezing means


def test_refreeze_frees_cycles_among_frozen_objects_that_were_dropped():
    out = run()
    assert out["dropped frozen cycle alive after refreeze"] == "False"
    assert out["frozen after refreeze"] == "True"


def test_edge_gc_freeze_0_leaves_the_collector_alone():
    out = run({"EDGE_GC_FREEZE": "0"})
    assert out["frozen"] == "0"
    assert out["dropped frozen cycle alive after a collection"] == "False"
