"""The cyclic garbage collector after start-up: what the edge built to serve is moved out of its way.

A serving edge holds ~25-40k objects the collector tracks (imported modules, the configuration, the
tables, redis-py when a store is on Redis), made at start-up and kept for the process's life. A full
collection walks every one of them with the GIL held: 9-16 ms of CPU for 38k objects in a serving edge
on Redis on this 2-CPU VM, a pause every request in flight waits out. gc.freeze() moves every object
tracked now into a permanent generation that collections skip (the same collection then took 0.9-3 ms,
67 objects left to walk), as Instagram did for its Django workers. Frozen objects are still freed by reference counting; only a reference cycle among
them is kept, so start-up's garbage is collected first.

Under steady load the collector hardly runs here (a request's objects die by reference counting: at
2,000 req/s, 2 young collections and at most one middle one per 10 s, no full one; docs/journal/
issue31-latency-redis.md), so this takes a rare multi-ms pause off the tail rather than CPU off each
request. A reload replaces part of what was frozen: refreeze() (after() a reload) hands it back to the collector (one full
collection, then freeze again), so cycles among the replaced objects are freed instead of kept forever.

EDGE_GC_FREEZE=0 leaves the collector as CPython has it: for the side-by-side benchmark
(bench/tail_bench.py, `env=EDGE_GC_FREEZE=0`), not a tuning knob.
"""

from __future__ import annotations

import gc
import os


def enabled() -> bool:
    return os.environ.get("EDGE_GC_FREEZE", "1") != "0"


def freeze_startup() -> int:
    """Collect start-up's garbage, then freeze what is left; returns how many objects are frozen."""
    if not enabled():
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def after(*steps):
    """A function that runs steps (a reload's), then refreeze()s: for the reload thread."""

    def run() -> None:
        for step in steps:
            step()
        refreeze()

    return run


def refreeze() -> int:
    """After a reload: give the frozen objects back to the collector, collect, freeze again."""
    if not enabled():
        return 0
    gc.unfreeze()
    return freeze_startup()
