"""Milestone 2, the spec's acceptance line:

    "Round robin — 90 requests across 3 backends land exactly 30/30/30; killing one backend yields 502 on
    its turns and no balancer crash."

With the edge's defaults (only --backends) 90 concurrent requests land 30/30/30. A killed backend:

- the spec's behaviour is one flag away, `--retries 0` (by default a connect failure is retried on
  another backend, so with the defaults the clients see no 502 at all: checked here too);
- with `--retries 0` and everything else default, its turns are 502s until passive health ejects it
  (`--eject-after 5`: five consecutive failures, then 30 s out of rotation), after which the other two
  take its turns: its first five turns are 502s, then none;
- the line to the letter -- a 502 on every one of its turns -- is `--retries 0 --eject-after 0`
  (ejection off; the active checks, every 10 s by default, have not yet seen it fail twice).
In every case the edge keeps serving.
"""

from __future__ import annotations

import http.client
import threading

import pytest

from tests.support import Backend, Edge, request

pytestmark = pytest.mark.acceptance


def counts(backends):
    return {s["name"]: s["count"] for s in (b.stats() for b in backends)}


def test_ninety_requests_land_thirty_thirty_thirty(backends):
    e = Edge("--backends", ",".join(b.url for b in backends))
    before = counts(backends)
    statuses = []
    try:
        def client():          # nine concurrent keep-alive clients, ten requests each
            c = http.client.HTTPConnection("127.0.0.1", e.port, timeout=10)
            for _ in range(10):
                statuses.append(request(e.port, "GET", "/", conn=c).status)
            c.close()

        threads = [threading.Thread(target=client) for _ in range(9)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        e.stop()
    after = counts(backends)
    assert statuses.count(200) == 90
    assert {k: after[k] - before[k] for k in after} == {"a": 30, "b": 30, "c": 30}


def test_a_killed_backend_gives_502_on_its_turns_and_the_edge_stays_up():
    bs = [Backend(n) for n in ("x", "y", "z")]
    urls = ",".join(b.url for b in bs)
    literal = Edge("--backends", urls, "--retries", "0", "--eject-after", "0", name="edge-literal")
    no_retries = Edge("--backends", urls, "--retries", "0", name="edge-no-retries")
    defaults = Edge("--backends", urls, name="edge-defaults")
    try:
        bs[1].kill()
        got = {name: [request(e.port, "GET", "/").status for _ in range(90)]
               for name, e in (("literal", literal), ("no_retries", no_retries), ("defaults", defaults))}
        assert got["literal"] == [200, 502, 200] * 30               # every one of its 30 turns
        assert got["no_retries"] == [200, 502, 200] * 5 + [200] * 75  # its turns until ejected, then none
        assert "EJECTED for 30s: 5 consecutive failed requests" in no_retries.log()
        assert got["defaults"] == [200] * 90                        # retried on the others
        for e in (literal, no_retries, defaults):
            assert e.alive() and request(e.port, "GET", "/").status == 200
    finally:
        for e in (literal, no_retries, defaults):
            e.stop()
        for b in bs:
            b.stop()
