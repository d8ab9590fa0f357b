"""The composed edge: limiter in front of backend selection, the 429 contract, identity, metrics."""

import http.client
import re
import threading
import time
from collections import Counter

import pytest

from tests.support import Backend, Edge, request, wait_until

ALGORITHMS = ["token-bucket", "fixed-window", "sliding-log", "sliding-counter"]


def total(backends):
    return sum(b.stats()["count"] for b in backends)


def rl(resp):
    return {k: resp.header(k) for k in ("X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset",
                                        "Retry-After")}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_over_the_limit_gets_429_with_the_full_contract_and_backends_see_nothing(backends, algorithm):
    e = Edge("--backends", ",".join(b.url for b in backends), "--limit", "5/m", "--algorithm", algorithm)
    try:
        before = total(backends)
        got = [request(e.port, "GET", "/", {"X-Api-Key": "greedy"}) for _ in range(12)]
        assert [r.status for r in got] == [200] * 5 + [429] * 7
        for i, r in enumerate(got):
            h = rl(r)
            assert h["X-RateLimit-Limit"] == "5"
            assert h["X-RateLimit-Remaining"] == str(max(0, 4 - i))
            assert int(h["X-RateLimit-Reset"]) >= 1
        rejected = got[-1]
        assert 1 <= int(rejected.header("Retry-After")) <= 60
        assert b"rate limit" in rejected.body
        assert total(backends) - before == 5           # no rejected request reached a backend
    finally:
        e.stop()


def obedient_client(port: int, key: str, seconds: float) -> Counter:
    """Sends as fast as allowed: while Remaining > 0; at 0 it waits Reset (or Retry-After) seconds."""
    seen = Counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        r = request(port, "GET", "/", {"X-Api-Key": key}, conn=conn)
        seen[r.status] += 1
        if r.status == 429:
            time.sleep(int(r.header("Retry-After")))
        elif int(r.header("X-RateLimit-Remaining")) == 0:
            time.sleep(int(r.header("X-RateLimit-Reset")))   # the client paces itself: not a sync sleep
    conn.close()
    return seen


def test_a_client_that_obeys_the_headers_never_sees_a_429(backends):
    """10 s of demand above the limit, for each algorithm, the four edges side by side."""
    edges = {a: Edge("--backends", backends[0].url, "--limit", "20/2s", "--algorithm", a,
                     name=f"edge-{a}") for a in ALGORITHMS}
    results = {}
    try:
        threads = [threading.Thread(target=lambda a=a: results.__setitem__(a, obedient_client(
            edges[a].port, "polite", 10.0))) for a in ALGORITHMS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
    finally:
        for e in edges.values():
            e.stop()
    for a in ALGORITHMS:
        print(f"{a}: {dict(results[a])}")
        assert results[a][429] == 0, (a, results[a])
        assert results[a][200] >= 40, (a, results[a])   # and it did get its quota, several windows of it


def test_keys_and_addresses_are_limited_independently(backends):
    e = Edge("--backends", backends[0].url, "--limit", "2/m", "--trusted-proxies", "127.0.0.3/32")
    try:
        def status(key=None, src="127.0.0.1", xff=None):
            c = http.client.HTTPConnection("127.0.0.1", e.port, timeout=5, source_address=(src, 0))
            h = {}
            if key:
                h["X-Api-Key"] = key
            if xff:
                h["X-Forwarded-For"] = xff
            try:
                return request(e.port, "GET", "/", h, conn=c).status
            finally:
                c.close()

        assert [status("k1") for _ in range(3)] == [200, 200, 429]
        assert [status("k2") for _ in range(3)] == [200, 200, 429]        # another key: untouched
        assert [status(src="127.0.0.1") for _ in range(3)] == [200, 200, 429]
        assert [status(src="127.0.0.2") for _ in range(3)] == [200, 200, 429]   # another IP
        # An untrusted peer cannot pick its identity with X-Forwarded-For: still 127.0.0.2, still limited.
        assert status(src="127.0.0.2", xff="198.51.100.9") == 429
        # A trusted proxy's X-Forwarded-For names the client: the rightmost untrusted hop.
        assert [status(src="127.0.0.3", xff="198.51.100.9") for _ in range(3)] == [200, 200, 429]
        assert status(src="127.0.0.3", xff="203.0.113.1, 198.51.100.10") == 200   # a new client
        # A key that looks like an address does not spend that address's quota.
        assert status(key="127.0.0.9") == 200 and status(src="127.0.0.1", key=None) == 429
        assert request(e.port, "GET", "/", {"X-Api-Key": "x" * 300}).status == 400
    finally:
        e.stop()


def test_rejected_requests_take_no_round_robin_turn(backends):
    """Two backends: if a rejected request took a turn, the other key would always land on one backend."""
    a, b = backends[:2]
    e = Edge("--backends", f"{a.url},{b.url}", "--limit", "4/m", "--key-limit", "free=1000/m")
    try:
        assert [request(e.port, "GET", "/", {"X-Api-Key": "greedy"}).status for _ in range(4)] == [200] * 4
        before = {x.name: x.stats()["count"] for x in (a, b)}
        seq = []
        for _ in range(10):
            assert request(e.port, "GET", "/", {"X-Api-Key": "greedy"}).status == 429
            seq.append(request(e.port, "GET", "/", {"X-Api-Key": "free"}).body.decode().strip())
        assert seq == ["a", "b"] * 5
        after = {x.name: x.stats()["count"] for x in (a, b)}
        assert {k: after[k] - before[k] for k in after} == {a.name: 5, b.name: 5}
    finally:
        e.stop()


def test_a_503_spends_the_token_and_the_counters_say_so():
    b = Backend("lonely")
    e = Edge("--backends", b.url, "--limit", "3/m", "--admin", "127.0.0.1:0", "--health-interval", "0.1",
             "--unhealthy-threshold", "1")
    try:
        request(b.port, "POST", "/_ctl/down")
        wait_until(lambda: "DOWN" in e.log(), timeout=5, what="backend DOWN")
        got = [request(e.port, "GET", "/", {"X-Api-Key": "k"}) for _ in range(5)]
        assert [r.status for r in got] == [503, 503, 503, 429, 429]
        assert [r.header("X-RateLimit-Remaining") for r in got] == ["2", "1", "0", "0", "0"]
        metrics = request(e.admin_port, "GET", "/metrics").body.decode()
        assert "lb_unavailable_total 3" in metrics.splitlines()
        assert 'lb_rate_limited_total{rule="default",dry_run="false"} 2' in metrics.splitlines()
    finally:
        e.stop()
        b.stop()


def test_metrics_parse_as_prometheus_text_and_status_is_json(backends):
    from prometheus_client.parser import text_string_to_metric_families
    import json
    e = Edge("--backends", ",".join(b.url for b in backends), "--admin", "127.0.0.1:0", "--limit", "100/s")
    try:
        for _ in range(6):
            request(e.port, "GET", "/")
        text = request(e.admin_port, "GET", "/metrics").body.decode()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        assert {"lb_requests", "lb_rate_limited", "lb_unavailable", "lb_backend_up",
                "lb_request_duration_seconds", "lb_upstream_errors"} <= set(fams)
        per_backend = {s.labels["backend"]: s.value for s in fams["lb_requests"].samples}
        assert sorted(per_backend.values()) == [2, 2, 2]
        hist = {s.labels["code"]: s.value for s in fams["lb_request_duration_seconds"].samples if "count" in s.name}
        assert hist["2xx"] == 6 and sum(hist.values()) == 6
        status = json.loads(request(e.admin_port, "GET", "/status").body)
        assert [b["state"] for b in status["backends"]] == ["UP"] * 3
        assert request(e.admin_port, "GET", "/nope").status == 404
    finally:
        e.stop()


def test_backend_ratelimit_headers_are_replaced_not_duplicated(backends):
    e = Edge("--backends", backends[0].url, "--limit", "10/s")
    try:
        # The echo route reflects nothing back as headers, so use the edge's contract on a plain GET.
        r = request(e.port, "GET", "/")
        assert [k for k, _ in r.headers].count("X-RateLimit-Limit") == 1
    finally:
        e.stop()


def test_sticky_sessions(backends):
    e = Edge("--backends", ",".join(b.url for b in backends), "--sticky")
    try:
        first = request(e.port, "GET", "/")
        cookie = first.header("Set-Cookie")
        assert cookie and cookie.startswith("route=")
        route = cookie.split(";")[0]
        pinned = {request(e.port, "GET", "/", {"Cookie": route}).body for _ in range(6)}
        assert pinned == {first.body}
        # An unknown route is reassigned (a new cookie), never an error.
        r = request(e.port, "GET", "/", {"Cookie": "route=nonsense"})
        assert r.status == 200 and r.header("Set-Cookie").startswith("route=")
    finally:
        e.stop()


def test_access_log_has_one_line_per_request(backends, tmp_path):
    path = tmp_path / "access.log"
    e = Edge("--backends", backends[0].url, "--access-log", str(path), "--limit", "1/m")
    try:
        request(e.port, "GET", "/one", {"X-Api-Key": "k"})
        request(e.port, "GET", "/two", {"X-Api-Key": "k"})
        wait_until(lambda: path.exists() and len(path.read_text().splitlines()) == 2, timeout=5,
                   what="two access-log lines")
        # in either order: /one is logged after its response went out, which can be after /two's 429
        one, two = sorted(path.read_text().splitlines(), key=lambda line: '"GET /two"' in line)
        assert ' 127.0.0.1 "GET /one" 200 ' in one and " " + backends[0].url + " " in one
        assert ' 127.0.0.1 "GET /two" 429 ' in two and " - - " in two     # no upstream, no upstream time
        tag = re.search(r" key=(#[0-9a-f]{12}) ", one).group(1)
        assert f" key={tag} " in two                  # the same client, never the raw key
        assert " limited_by=- " in one and " limited_by=default " in two    # the rule that rejected
        assert " tries=1 " in one and " tries=0 " in two                    # the 429 reached no backend
    finally:
        e.stop()


def test_forwarding_headers_from_a_trusted_proxy_pass_through_and_others_are_replaced(backends):
    import json
    e = Edge("--backends", backends[0].url, "--trusted-proxies", "127.0.0.3/32")
    try:
        def seen(src):
            c = http.client.HTTPConnection("127.0.0.1", e.port, timeout=5, source_address=(src, 0))
            try:
                r = request(e.port, "GET", "/echo", {"Host": "api.example", "X-Forwarded-Proto": "https",
                                                     "X-Forwarded-Host": "public.example",
                                                     "X-Forwarded-For": "203.0.113.5"}, conn=c)
            finally:
                c.close()
            return {k.lower(): v for k, v in json.loads(r.body)["headers"]}
        tls = seen("127.0.0.3")       # e.g. the TLS terminator in front
        assert tls["x-forwarded-proto"] == "https" and tls["x-forwarded-host"] == "public.example"
        assert tls["x-forwarded-for"] == "203.0.113.5, 127.0.0.3"
        other = seen("127.0.0.2")
        assert other["x-forwarded-proto"] == "http" and other["x-forwarded-host"] == "api.example"
        assert other["x-forwarded-for"] == "203.0.113.5, 127.0.0.2"
    finally:
        e.stop()
