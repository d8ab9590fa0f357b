"""Milestone 7, the spec's acceptance line:

    "Distributed counters — with two edges and local buckets, a client demonstrably exceeds its quota
    (~2×); switching to the shared atomic store brings admitted rate within 2% of the limit; the
    accuracy-vs-latency table for both setups is filled in."

Two pairs of edges side by side, each pair behind one client alternating between its two edges at twice
the limit: the memory store (each edge its own counters: ~2x the limit admitted) and a real
redis-server (tests/redis_server.py; one counter per window for both edges: within 2%). The edges'
defaults except what the line names -- a limit and the store -- and two choices of this test's:
fixed-window rather than the default token bucket (its windows are aligned to the epoch second, so
whole windows can be counted exactly), and --redis-timeout 1.0 (accuracy, not faults: a loaded machine
must not fail open). The table -- accuracy and the added latency of
each setup -- is measured by `python3 bench/redis_bench.py` (it uses this test's client) and filled in
README.md (the accuracy table in "Many edges, one limit", the latency in "Performance") and
docs/redis.md: figures are measured in benchmarks, not asserted in a timed test.
"""

from __future__ import annotations

import math
import threading
import uuid
from collections import Counter

import pytest

from tests.support import Backend, Edge
from tests.test_edge_redis import admitted_per_second, paced_alternating

pytestmark = pytest.mark.acceptance


def test_two_edges_one_client_at_twice_the_limit_redis_holds_the_limit_memory_doubles_it(redis_server):
    """fixed-window 25/s on every edge; one client alternates between two edges at 50 req/s for 12 s.

    Measured in the steady state: the whole 1-s windows (the edges' windows are aligned to the epoch
    second) from the second full window on, 10 of them -- so no partial window at either end and no
    start-up effect.  Local counters: each edge sees 50/s and admits all of it (about 2x the limit).
    Redis: the two edges share one counter per window: 25/s, within 2%.  Both configurations run at once.
    """
    backend = Backend("m7")
    limit, demand = 25, 50   # (50/100 did not keep up here when the suite shared 2 cores with others)
    common = ["--backends", backend.url, "--limit", f"{limit}/s", "--algorithm", "fixed-window"]
    # A generous Redis timeout: this test is about accuracy, not faults (a loaded CI box must not fail open).
    mem = [Edge(*common, name=f"edge-mem-{i}") for i in "ab"]
    red = [Edge(*common, "--store", redis_server.url, "--redis-timeout", "1.0", name=f"edge-redis-{i}")
           for i in "ab"]
    results = {}
    try:
        key = f"client-{uuid.uuid4().hex[:8]}"
        threads = [threading.Thread(target=lambda n=n, es=es: results.__setitem__(
            n, paced_alternating([e.port for e in es], key, demand, 12.5))) for n, es in (("memory", mem),
                                                                                           ("redis", red))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert set(results) == {"memory", "redis"}
    finally:
        for e in mem + red:
            e.stop()
        backend.stop()
    first = min(s[0][0] for s in results.values())
    t0 = math.ceil(first) + 1.0  # skip the first (partial) window and the one after, then 10 whole windows
    t1 = t0 + 10.0
    rates = {n: admitted_per_second(s, t0, t1) for n, s in results.items()}
    sent = {n: sum(1 for t, _, _ in s if t0 <= t < t1) / 10.0 for n, s in results.items()}
    print(f"\nlimit {limit}/s, client {sent['memory']:.1f} req/s over two edges: memory admits "
          f"{rates['memory']:.1f}/s ({rates['memory'] / limit:.2f}x), redis admits {rates['redis']:.1f}/s "
          f"({rates['redis'] / limit:.3f}x); redis sent {sent['redis']:.1f} req/s")
    assert sent["redis"] >= 1.9 * limit   # the demand on the shared store really was 2x
    # Memory: each edge admits its own limit, so it admits what was sent, up to 2x. Judged against what
    # the client managed to send: on a loaded machine the paced client fell to 42 of 50 req/s (flaky).
    assert sent["memory"] >= 1.5 * limit and rates["memory"] >= 0.95 * min(sent["memory"], 2 * limit)
    assert abs(rates["redis"] - limit) <= 0.02 * limit
    statuses = Counter(st for _, st, _ in results["redis"])
    assert set(statuses) <= {200, 429}, statuses  # no fail-open / 503 slipped in
