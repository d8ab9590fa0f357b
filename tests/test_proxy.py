"""The edge core against real processes: transparency, balancing, failures, health, configuration."""

import http.client
import json
import re
import subprocess
import threading
from collections import Counter

import pytest

from tests.support import PY, ROOT, Backend, Edge, free_port, raw, request, wait_until

FORWARDING = {"x-forwarded-for", "x-forwarded-proto", "x-forwarded-host"}
HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
       "proxy-authorization", "proxy-authenticate"}


@pytest.fixture
def edge(backends):
    e = Edge("--backends", ",".join(b.url for b in backends), "--health-interval", "30")
    yield e
    e.stop()


def counts(backends):
    return {s["name"]: s["count"] for s in (b.stats() for b in backends)}


def delta(before, after):
    return {k: after[k] - before[k] for k in after}


def headers_without(resp, drop):
    return [(k.lower(), v) for k, v in resp.headers if k.lower() not in drop]


# ----------------------------------------------------------------------------------- transparency

@pytest.mark.parametrize("path", ["/", "/some/path?q=1&r=%20x", "/cookies", "/chunked?parts=4"])
def test_get_direct_and_proxied_differ_only_by_the_header_rules(backends, path):
    single = backends[0]
    e = Edge("--backends", single.url, "--health-interval", "30")
    try:
        direct = request(single.port, "GET", path)
        proxied = request(e.port, "GET", path)
    finally:
        e.stop()
    assert proxied.status == direct.status
    assert proxied.body == direct.body
    # Same headers, same order, duplicates kept (Set-Cookie twice); Date may tick over a second; nothing
    # added (the request id goes to the backend, and to the client only with --request-id-response).
    drop = HOP | {"date"}
    assert headers_without(proxied, drop) == headers_without(direct, drop)
    assert not proxied.header("X-Request-Id") and not direct.header("X-Request-Id")
    assert proxied.header("Date") and proxied.header("Server") == direct.header("Server")


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_post_body_arrives_byte_for_byte(backends, framing):
    single = backends[1]
    e = Edge("--backends", single.url, "--health-interval", "30")
    payload = bytes(range(256)) * 1000  # 256 kB: larger than one read, streamed
    try:
        hdrs = [("Host", "api.example"), ("Content-Type", "application/octet-stream"), ("X-Custom", "kept")]
        if framing == "chunked":
            body = b"".join(b"%x\r\n%s\r\n" % (len(payload[i:i + 70000]), payload[i:i + 70000])
                            for i in range(0, len(payload), 70000)) + b"0\r\n\r\n"
            hdrs.append(("Transfer-Encoding", "chunked"))
        else:
            body = payload
        direct = json.loads(request(single.port, "POST", "//echo/x?a=b", hdrs, body).body)
        proxied = json.loads(request(e.port, "POST", "//echo/x?a=b", hdrs, body).body)
    finally:
        e.stop()
    import hashlib
    assert proxied["body_sha256"] == hashlib.sha256(payload).hexdigest() == direct["body_sha256"]
    assert proxied["method"] == "POST"
    assert proxied["target"] == "//echo/x?a=b" == direct["target"]   # byte for byte, leading // kept

    def names(info):
        return [(k.lower(), v) for k, v in info["headers"] if k.lower() not in HOP | {"content-length"}]
    # The backend sees the client's headers in order (Host unchanged), then the forwarding headers and
    # the request's id (the client sent none: the edge's).
    got = names(proxied)
    assert got[:-4] == [(k, v) for k, v in names(direct)]
    assert got[-4:-1] == [("x-forwarded-for", "127.0.0.1"), ("x-forwarded-proto", "http"),
                          ("x-forwarded-host", "api.example")]
    assert got[-1][0] == "x-request-id" and len(got[-1][1]) == 32
    assert got[0] == ("host", "api.example")
    assert not any(k in ("user-agent", "accept-encoding") for k, _ in got)  # nothing invented


@pytest.mark.parametrize("flag", [False, True])
def test_the_request_id_reaches_the_client_only_with_request_id_response(flag):
    """Off (the default), a response carries the backend's own X-Request-Id as it sent it, or none, and the
    edge's own answers (a 502 here) carry none; with --request-id-response every response carries the id
    the backend got, in place of the backend's. The backend gets the id either way."""
    from tests.rawserver import ConnReader, RawServer

    def answer(s, _server):           # echoes the X-Request-Id it got; /own also sends one of its own
        r = ConnReader(s)
        while (head := r.head()) is not None:
            m = re.search(rb"\r\nX-Request-Id: (\S+)", head)
            got = m.group(1) if m else b"-"          # (the health probes carry none)
            own = b"X-Request-Id: backend-own\r\n" if b" /own " in head else b""
            s.sendall(b"HTTP/1.1 200 OK\r\n%sContent-Length: %d\r\n\r\n%s" % (own, len(got), got))

    b = RawServer(answer)
    dead = f"http://127.0.0.1:{free_port()}"
    e = Edge("--backends", b.url, "--health-interval", "30", *(["--request-id-response"] if flag else []))
    e2 = Edge("--backends", dead, "--health-interval", "30", *(["--request-id-response"] if flag else []))
    try:
        plain = request(e.port, "GET", "/", {"X-Request-Id": "client-1"})
        own = request(e.port, "GET", "/own")
        failed = request(e2.port, "GET", "/")
    finally:
        e.stop()
        e2.stop()
        b.close()
    assert plain.body == b"client-1" and re.fullmatch(rb"[0-9a-f]{32}", own.body)    # the backend got it
    ids = lambda r: [v for k, v in r.headers if k.lower() == "x-request-id"]      # noqa: E731
    assert failed.status == 502
    if flag:
        assert ids(plain) == ["client-1"] and ids(own) == [own.body.decode()] and len(ids(failed)[0]) == 32
    else:
        assert ids(plain) == [] and ids(own) == ["backend-own"] and ids(failed) == []


def test_hop_by_hop_headers_are_stripped_both_ways_and_forwarding_appended(backends, edge):
    r = request(edge.port, "GET", "/echo", [("Connection", "keep-alive, X-Secret"), ("X-Secret", "s"),
                                            ("Keep-Alive", "timeout=5"), ("TE", "trailers"),
                                            ("Upgrade", "websocket"), ("Proxy-Authorization", "x"),
                                            ("X-Forwarded-For", "203.0.113.7")])
    seen = {k.lower(): v for k, v in json.loads(r.body)["headers"]}
    for h in ("connection", "x-secret", "keep-alive", "te", "upgrade", "proxy-authorization"):
        assert h not in seen
    assert seen["x-forwarded-for"] == "203.0.113.7, 127.0.0.1"   # appended, as nginx/HAProxy do


def test_keep_alive_carries_many_requests_on_one_connection(backends, edge):
    c = http.client.HTTPConnection("127.0.0.1", edge.port, timeout=5)
    names = [request(edge.port, "GET", "/", conn=c).body for _ in range(6)]
    c.close()
    assert sorted(set(names)) == [b"a\n", b"b\n", b"c\n"]


def test_a_reused_connection_the_backend_closed_is_retried_once_and_nothing_runs_twice(backends):
    # The backend closes every connection right after its response, unannounced: each next GET finds
    # its pooled connection dead -- seen by the pool's check when the close has arrived, else when the
    # request fails on it, and then retried once on a new one. No 502, and the backend saw each
    # request exactly once.
    b = backends[0]
    e = Edge("--backends", b.url, "--health-interval", "30", name="edge-close-after")
    try:
        before = b.stats()["count"]
        c = http.client.HTTPConnection("127.0.0.1", e.port, timeout=10)
        statuses = [request(e.port, "GET", "/close-after", conn=c).status for _ in range(10)]
        c.close()
        assert statuses == [200] * 10
        assert b.stats()["count"] - before == 10
    finally:
        e.stop()


def test_large_response_is_streamed(backends, edge):
    r = request(edge.port, "GET", "/big?bytes=5000000")
    assert r.status == 200 and len(r.body) == 5_000_000


def test_head_and_http10(backends, edge):
    r = request(edge.port, "HEAD", "/")
    assert r.status == 200 and r.body == b"" and r.header("Content-Length") == "2"
    out = raw(edge.port, b"GET / HTTP/1.0\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 200 ") and out.endswith((b"a\n", b"b\n", b"c\n"))


# -------------------------------------------------------------------------------------- balancing

def test_ninety_concurrent_requests_land_thirty_each(backends, edge):
    before = counts(backends)
    results = []

    def client():
        c = http.client.HTTPConnection("127.0.0.1", edge.port, timeout=10)
        for _ in range(10):
            results.append(request(edge.port, "GET", "/", conn=c).status)
        c.close()

    threads = [threading.Thread(target=client) for _ in range(9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results.count(200) == 90
    assert delta(before, counts(backends)) == {"a": 30, "b": 30, "c": 30}


@pytest.mark.parametrize("strategy", ["round-robin", "weighted"])
def test_equal_weights_rotate_in_order(backends, strategy):
    e = Edge("--backends", ",".join(b.url for b in backends), "--strategy", strategy)
    try:
        seq = [request(e.port, "GET", "/").body.decode().strip() for _ in range(9)]
    finally:
        e.stop()
    assert seq == ["a", "b", "c"] * 3


def test_weights_three_one_one_interleave(backends):
    a, b, c = backends
    e = Edge("--backends", f"{a.url}=3,{b.url},{c.url}")
    try:
        seq = [request(e.port, "GET", "/").body.decode().strip() for _ in range(20)]
    finally:
        e.stop()
    assert seq[:5] == ["a", "b", "a", "c", "a"]        # smooth: never a run of three
    for i in range(0, 20, 5):
        assert Counter(seq[i:i + 5]) == {"a": 3, "b": 1, "c": 1}
    assert "a,a,a" not in ",".join(seq)


# --------------------------------------------------------------------------------------- failures

def test_a_dead_backend_answers_502_on_its_turns_and_the_edge_stays_up():
    """The spec's floor, with retries off (by default a connect failure is retried: test_failover.py)."""
    bs = [Backend(n) for n in ("x", "y", "z")]
    e = Edge("--backends", ",".join(b.url for b in bs), "--health-interval", "60", "--retries", "0")
    try:
        bs[1].kill()
        statuses = [request(e.port, "GET", "/").status for _ in range(9)]
        assert statuses == [200, 502, 200] * 3
        assert e.alive()
        assert "backend http://127.0.0.1:%d connect" % bs[1].port in e.log()
    finally:
        e.stop()
        for b in bs:
            b.stop()


def test_backend_failures_map_to_502_and_504(backends):
    e = Edge("--backends", backends[0].url, "--read-timeout", "0.5", "--health-interval", "60")
    try:
        assert request(e.port, "GET", "/garbage").status == 502
        assert request(e.port, "GET", "/hang").status == 504
        assert request(e.port, "GET", "/").status == 200
        # Reset inside a small body, before anything reached the client: a clean 502.
        assert request(e.port, "GET", "/reset").status == 502
        # Reset mid-way through a large, streamed body: the head is gone, so the client connection is
        # closed and the body is short of its Content-Length (never looks complete).
        c = http.client.HTTPConnection("127.0.0.1", e.port, timeout=5)
        c.request("GET", "/reset?promise=1000000&send=300000")
        r = c.getresponse()
        with pytest.raises(http.client.IncompleteRead):
            r.read()
        c.close()
        assert request(e.port, "GET", "/").status == 200
        assert e.alive()
    finally:
        e.stop()


def test_health_checks_take_a_dead_backend_out_and_bring_it_back():
    bs = [Backend(n) for n in ("p", "q")]
    interval, threshold = 0.2, 2
    e = Edge("--backends", ",".join(b.url for b in bs), "--health-interval", str(interval),
             "--unhealthy-threshold", str(threshold), "--healthy-threshold", str(threshold))
    port = bs[1].port
    try:
        bs[1].kill()
        # Continuous traffic: within ~threshold x interval clients stop seeing 502.
        wait_until(lambda: "DOWN" in e.log(), timeout=threshold * interval + 3, what="DOWN transition")
        assert all(request(e.port, "GET", "/").status == 200 for _ in range(10))
        bs[1] = Backend("q", port=port)
        wait_until(lambda: "UP" in e.log().split("DOWN", 1)[1], timeout=threshold * interval + 3,
                   what="UP transition")
        got = Counter(request(e.port, "GET", "/").body for _ in range(10))
        assert got == {b"p\n": 5, b"q\n": 5}
        log = e.log()
        assert f"backend http://127.0.0.1:{port} DOWN" in log and f"backend http://127.0.0.1:{port} UP" in log
    finally:
        e.stop()
        for b in bs:
            b.stop()


def test_nobody_healthy_answers_503(backends):
    b = Backend("solo")
    e = Edge("--backends", b.url, "--health-interval", "0.1", "--unhealthy-threshold", "1")
    try:
        request(b.port, "POST", "/_ctl/down")
        wait_until(lambda: "DOWN" in e.log(), timeout=5, what="DOWN")
        r = request(e.port, "GET", "/")
        assert r.status == 503 and b"no healthy backend" in r.body
    finally:
        e.stop()
        b.stop()


# ---------------------------------------------------------------------------------- configuration

@pytest.mark.parametrize("args,needle", [
    (["--backends", "http://127.0.0.1:1=0"], "weight"),
    (["--backends", "http://127.0.0.1:1=-2"], "weight"),
    (["--backends", "ftp://127.0.0.1:1"], "bad backend URL"),
    (["--backends", "http://127.0.0.1:1,,"], "empty entry"),
    (["--backends", "http://127.0.0.1:1", "--unhealthy-threshold", "0"], "--unhealthy-threshold"),
    (["--backends", "http://127.0.0.1:1", "--health-interval", "-1"], "--health-interval"),
    (["--backends", "http://127.0.0.1:1", "--strategy", "random"], "strategy"),
    ([], "backends"),
])
def test_bad_configuration_exits_2_with_one_clear_line(args, needle):
    p = subprocess.run([PY, "edge.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=20)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in p.stderr, p.stderr


def test_bad_configuration_file(tmp_path):
    f = tmp_path / "edge.toml"
    f.write_text('[[backends]]\nurl = "http://127.0.0.1:9"\n[health]\nintervall = 3\n')
    p = subprocess.run([PY, "edge.py", "--config", str(f)], cwd=ROOT, capture_output=True, text=True, timeout=20)
    assert p.returncode == 2 and "health.intervall: unknown key" in p.stderr


def test_example_config_file_starts(backends, tmp_path):
    text = (ROOT / "conf" / "edge.toml").read_text()
    e = Edge("--config", str(ROOT / "conf" / "edge.toml"), "--backends", backends[0].url)
    try:
        assert request(e.port, "GET", "/").status == 200
    finally:
        e.stop()
    assert "[health]" in text
