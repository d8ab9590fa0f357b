"""Failover with real processes: health probes at once, least-request, slow start, drain via the admin
API; retries and passive ejection. Issue 12's acceptance items are marked [1]..[6]."""

import http.client
import json
import signal
import threading
import time
from collections import Counter

import pytest

from tests.support import Backend, Edge, free_port, request, wait_until
from tests.test_ops import Traffic, write_config


def admin(e, method, path):
    c = http.client.HTTPConnection("127.0.0.1", e.admin_port, timeout=5)
    try:
        c.request(method, path)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def status(e):
    return json.loads(admin(e, "GET", "/status")[1])


def metric(e, line_prefix):
    """The value of the first /metrics line starting with line_prefix (0 when absent)."""
    for line in admin(e, "GET", "/metrics")[1].decode().splitlines():
        if line.startswith(line_prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def hostport(b):
    return f"127.0.0.1:{b.port}"


def share(bodies, name):
    return sum(1 for x in bodies if x == name) / max(1, len(bodies))


# -------------------------------------------------------------------------------- probe at once

def test_the_first_probe_runs_at_once_at_start_and_on_reload(backends, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    e = Edge("--backends", f"{backends[0].url},{dead}", "--health-interval", "60", "--unhealthy-threshold", "1")
    try:
        # an interval of 60 s: only a probe at start can take it out within the deadline
        e.wait_log(rf"backend {dead} DOWN: 1 consecutive failed probes", timeout=10)
    finally:
        e.stop()
    cfg = tmp_path / "edge.toml"
    write_config(cfg, backends[:1], extra="unhealthy_threshold = 1\n")
    e = Edge("--config", str(cfg))
    try:
        dead = f"http://127.0.0.1:{free_port()}"
        cfg.write_text(cfg.read_text() + f'[[backends]]\nurl = "{dead}"\n')
        assert request(e.port).status == 200   # serving, so its SIGHUP handler is in place
        e.signal(signal.SIGHUP)
        e.wait_log(r"reloaded: 2 backends \(1 added")
        e.wait_log(rf"backend {dead} DOWN: 1 consecutive failed probes", timeout=10)   # interval is 30 s
    finally:
        e.stop()


# -------------------------------------------------------------------------------- [5] least-request

def run_clients(port, clients, seconds, path="/"):
    """Closed-loop clients on keep-alive connections; the bodies (backend names) of the answers."""
    out, errors = [], []
    end = time.monotonic() + seconds

    def run():
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        while time.monotonic() < end:
            try:
                r = request(port, "GET", path, conn=c)
                out.append((r.status, r.body))
            except (OSError, http.client.HTTPException) as e:
                errors.append(repr(e))
                c.close()
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        c.close()

    ts = [threading.Thread(target=run) for _ in range(clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(seconds + 30)
    return out, errors


@pytest.fixture(scope="module")
def one_slow():
    """Three backends, the third 10x slower (10 ms and 100 ms per answer)."""
    bs = [Backend("f1", 0, "--delay-ms", "10"), Backend("f2", 0, "--delay-ms", "10"),
          Backend("slow", 0, "--delay-ms", "100")]
    yield bs
    for b in bs:
        b.stop()


def test_least_request_routes_away_from_a_slow_backend(one_slow):
    """[5] Under 12 concurrent clients the slow backend's share is well under a third with least-request;
    round robin, for contrast, gives it exactly its turn."""
    urls = ",".join(b.url for b in one_slow)
    shares = {}
    for strategy in ("least-request", "round-robin"):
        e = Edge("--backends", urls, "--strategy", strategy, name=f"edge-{strategy}")
        try:
            out, errors = run_clients(e.port, clients=12, seconds=3)
        finally:
            e.stop()
        assert not errors and out and {s for s, _ in out} == {200}, (errors[:3], Counter(s for s, _ in out))
        shares[strategy] = share([b for _, b in out], b"slow\n")
    print("slow backend share", shares)
    assert shares["least-request"] < 0.15, shares
    assert abs(shares["round-robin"] - 1 / 3) < 0.05, shares


# -------------------------------------------------------------------------------- [4] slow start

def test_slow_start_ramps_a_backend_that_comes_back(backends):
    """[4] With real processes and the real clock: c leaves the rotation (drained: no health flapping
    to race with on a busy machine), comes back, and ramps from ~10% of its weight to all of it over
    --slow-start 3. The exact ramp is tested with an injected clock in tests/test_balancing.py, the
    rejoin after a DOWN there too."""
    a, b, c = backends
    e = Edge("--backends", ",".join(x.url for x in backends), "--slow-start", "3", "--admin", "127.0.0.1:0")
    t = Traffic(e.port, clients=4)
    try:
        assert admin(e, "POST", f"/backends/{hostport(c)}/drain")[0] == 200
        mark = time.monotonic()
        wait_until(lambda: sum(1 for ts, *_ in t.results if ts > mark) > 100, what="traffic without c")
        assert admin(e, "POST", f"/backends/{hostport(c)}/enable")[0] == 200
        back = wait_until(lambda: next((ts for ts, _, body in t.results if ts > mark and body == b"c\n"), None),
                          what="c's first answer")
        wait_until(lambda: t.results[-1][0] > back + 5.0, timeout=20, what="5 s of traffic after the return")
    finally:
        t.stop()
        e.stop()
    assert not t.errors, t.errors[:3]
    assert {s for _, s, _ in t.results} == {200}, Counter(s for _, s, _ in t.results)

    def window(lo, hi):
        return [body for ts, _, body in t.results if back + lo <= ts < back + hi]

    first, last = window(0, 0.75), window(3.5, 5.0)
    print("c share first 0.75 s", share(first, b"c\n"), "after 3.5 s", share(last, b"c\n"))
    assert len(first) > 30 and len(last) > 60, (len(first), len(last))
    # weight over the first 0.75 s: 0.10..0.25 -> share under 11%; after the ramp: a third
    assert share(first, b"c\n") < 0.2, Counter(first)
    assert abs(share(last, b"c\n") - 1 / 3) < 0.07, Counter(last)


# -------------------------------------------------------------------------------- [6] drain / enable

def test_drain_via_the_admin_api_under_traffic_loses_no_request(backends):
    """[6] POST /backends/<route>/drain: no new requests, the ones in flight finish, nothing is lost;
    /status and /metrics show it; /enable brings it back."""
    a, b, c = backends
    e = Edge("--backends", ",".join(x.url for x in backends), "--admin", "127.0.0.1:0")
    t = Traffic(e.port, clients=6, path="/slow?ms=30")
    try:
        wait_until(lambda: len(t.results) > 60, what="traffic before the drain")
        route = next(x["route"] for x in status(e)["backends"] if x["url"] == b.url)
        code, body = admin(e, "POST", f"/backends/{route}/drain")
        assert code == 200 and json.loads(body)["state"] == "DRAINED"
        wait_until(lambda: next(x for x in status(e)["backends"] if x["url"] == b.url)["inflight"] == 0,
                   what="b's in-flight requests to finish")
        drained_at, count = time.monotonic(), b.stats()["count"]
        wait_until(lambda: sum(1 for ts, *_ in t.results if ts > drained_at) > 60, what="traffic while drained")
        assert b.stats()["count"] == count                      # not one new request
        st = next(x for x in status(e)["backends"] if x["url"] == b.url)
        assert (st["state"], st["in_rotation"], st["drained"], st["health"]) == ("DRAINED", False, True, "UP")
        assert metric(e, f'lb_backend_drained{{backend="{b.url}"}}') == 1
        assert metric(e, f'lb_backend_in_rotation{{backend="{b.url}"}}') == 0
        assert metric(e, f'lb_admin_actions_total{{backend="{b.url}",action="drain"}}') == 1
        # by HOST:PORT too
        code, body = admin(e, "POST", f"/backends/{hostport(b)}/enable")
        assert code == 200 and json.loads(body)["state"] == "UP"
        wait_until(lambda: b.stats()["count"] > count + 5, what="b back in rotation")
        assert metric(e, f'lb_backend_drained{{backend="{b.url}"}}') == 0
        assert admin(e, "POST", "/backends/nope/drain")[0] == 404
        assert admin(e, "GET", f"/backends/{route}/drain")[0] == 405
    finally:
        t.stop()
        e.stop()
    assert not t.errors, t.errors[:3]
    assert Counter(s for _, s, _ in t.results) == {200: len(t.results)}
    assert "DRAINED by the admin API" in e.log() and "ENABLED by the admin API" in e.log()
