"""Milestone 6, the spec's acceptance line:

    "Composed edge — a scripted client exceeding its key's limit receives 429 with Retry-After and the
    three X-RateLimit-* headers; a client that obeys them never receives a 429; backends receive no
    rejected requests."

The edge's defaults (token bucket, memory store) and a limit, which the line needs: --limit. The backend
counts what reaches it (Backend.stats(): /health and /_ctl not counted), so "no rejected requests" is
its count against the 200s. The obedient client is tests/test_edge_limits.py's (that file runs it for
all four algorithms): it sends while Remaining > 0, and at 0 waits Reset (or, after a 429, Retry-After).
"""

from __future__ import annotations

import pytest

from tests.support import Backend, Edge, request
from tests.test_edge_limits import obedient_client

pytestmark = pytest.mark.acceptance


def test_the_429_contract_an_obedient_client_and_nothing_rejected_reaches_a_backend():
    backend = Backend("m6")
    e = Edge("--backends", backend.url, "--limit", "5/m")
    try:
        before = backend.stats()["count"]
        got = [request(e.port, "GET", "/", {"X-Api-Key": "greedy"}) for _ in range(12)]
        assert [r.status for r in got] == [200] * 5 + [429] * 7
        for i, r in enumerate(got):
            assert r.header("X-RateLimit-Limit") == "5"
            assert r.header("X-RateLimit-Remaining") == str(max(0, 4 - i))
            assert int(r.header("X-RateLimit-Reset")) >= 1
        for r in got[5:]:
            assert 1 <= int(r.header("Retry-After")) <= 60 and b"rate limit" in r.body
        assert backend.stats()["count"] - before == 5          # none of the seven 429s reached it
    finally:
        e.stop()
    e = Edge("--backends", backend.url, "--limit", "10/2s")
    try:
        before = backend.stats()["count"]
        seen = obedient_client(e.port, "polite", 6.0)          # demand above the limit, for 3 windows
        reached = backend.stats()["count"] - before
    finally:
        e.stop()
        backend.stop()
    assert seen[429] == 0, seen
    assert seen[200] >= 20, seen                               # and it did get its quota, window after window
    assert reached == seen[200]
