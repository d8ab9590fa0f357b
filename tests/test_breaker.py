"""The pool's circuit breaker (issue 28): past --max-requests in flight a request is a 503 at once,
never queued behind a slow backend; past --max-pending waiting for a connection, likewise."""

import json
import re
import threading
import time

from tests.support import Backend, Edge, request, wait_until


def metric(e, name, labels=""):
    text = request(e.admin_port, "GET", "/metrics").body.decode()
    m = re.search(r"^%s%s (\S+)$" % (re.escape(name), re.escape(labels)), text, re.M)
    return float(m.group(1)) if m else None


def burst(port, n, path):
    out = [None] * n

    def one(i):
        t = time.monotonic()
        r = request(port, "GET", path, timeout=20)
        out[i] = (r.status, time.monotonic() - t, r.body)

    ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return out


def test_max_requests_sheds_the_excess_at_once():
    b = Backend("slow")
    e = Edge("--backends", b.url, "--max-requests", "5", "--admin", "127.0.0.1:0", "--health-interval", "60")
    try:
        out = burst(e.port, 20, "/slow?ms=1000")
        ok = [o for o in out if o[0] == 200]
        shed = [o for o in out if o[0] == 503]
        assert len(ok) == 5 and len(shed) == 15, [o[:2] for o in out]
        # fast: not queued behind the backend's second (a loose bound: the machine is shared)
        assert all(o[1] < 0.8 for o in shed), [round(o[1], 3) for o in shed]
        assert b"max_requests" in shed[0][2]
        assert metric(e, "lb_overflow_total", '{limit="max_requests"}') == 15
        # every admitted request gave its place back: a new one is served, the gauge is at 0
        assert request(e.port, "GET", "/").status == 200
        assert metric(e, "lb_pool_requests_in_flight") == 0
        st = json.loads(request(e.admin_port, "GET", "/status").body)
        assert st["breaker"]["max_requests"] == 5 and st["breaker"]["overflow"]["max_requests"] == 15
    finally:
        e.stop()
        b.stop()


def test_max_pending_sheds_waiters_past_the_cap():
    # one connection to the backend: 1 in flight, 2 may wait for it (pool_timeout 10 s), the rest 503 at once
    b = Backend("slow")
    e = Edge("--backends", b.url, "--pool-maxsize", "1", "--pool-timeout", "10", "--max-pending", "2",
             "--admin", "127.0.0.1:0", "--health-interval", "60", "--retries", "0")
    try:
        out = burst(e.port, 8, "/slow?ms=700")
        ok = [o for o in out if o[0] == 200]
        shed = [o for o in out if o[0] == 503]
        assert len(ok) == 3 and len(shed) == 5, [o[:2] for o in out]
        assert all(o[1] < 0.6 for o in shed), [round(o[1], 3) for o in shed]
        assert metric(e, "lb_overflow_total", '{limit="max_pending"}') == 5
        assert request(e.port, "GET", "/").status == 200
        assert metric(e, "lb_pool_pending") == 0
    finally:
        e.stop()
        b.stop()


def test_off_by_default_nothing_is_shed():
    b = Backend("slow")
    e = Edge("--backends", b.url, "--admin", "127.0.0.1:0", "--health-interval", "60")
    try:
        out = burst(e.port, 12, "/slow?ms=300")
        assert all(o[0] == 200 for o in out), [o[:2] for o in out]
        assert metric(e, "lb_overflow_total", '{limit="max_requests"}') == 0
    finally:
        e.stop()
        b.stop()
